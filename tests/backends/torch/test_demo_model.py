"""The demo model runs on the torch runner, generated on first use, and matches transformers."""

from __future__ import annotations

import torch
from llmctl_torch.model import TorchModelRunner

from llmctl.model.config import ModelConfig
from llmctl.model.demo import demo_model_dir
from tests.helpers.tiny_models import PagedSequences, load_hf_model


def test_demo_model_is_materialized_by_the_loader_and_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    model_dir = demo_model_dir()
    assert not model_dir.exists()
    runner = TorchModelRunner(
        model_dir, ModelConfig.from_dir(model_dir), block_size=16, num_blocks=8
    )
    prompt = [1] + [3 + byte for byte in b"Once upon a time"]
    paged = PagedSequences(runner)
    paged.add(prompt)
    logits = paged.step({0: len(prompt)})
    with torch.no_grad():
        want = load_hf_model(model_dir)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=0)


def test_demo_model_writes_printable_ascii(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    model_dir = demo_model_dir()
    runner = TorchModelRunner(
        model_dir, ModelConfig.from_dir(model_dir), block_size=16, num_blocks=8
    )
    paged = PagedSequences(runner)
    paged.add([1] + [3 + byte for byte in b"Hello"])
    generator = torch.Generator().manual_seed(0)
    logits = paged.step({0: 6})
    for _ in range(30):
        paged.tokens[0].append(
            int(torch.multinomial(logits[0].softmax(-1), 1, generator=generator))
        )
        logits = paged.step({0: 1})
    new_bytes = bytes(token - 3 for token in paged.tokens[0][6:] if token >= 3)
    text = new_bytes.decode("utf-8", errors="replace")
    assert sum(char.isprintable() or char == "\n" for char in text) >= 25
