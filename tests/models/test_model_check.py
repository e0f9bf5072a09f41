"""The model-directory check against independent references: transformers' own checkpoints
(every architecture and bias variant must pass, with exactly the tensors expected) and the
safetensors library (damaged files: the hand-written header reader must refuse exactly
what the library refuses). Plus ``llmctl models DIR``, the view of what llmctl reads."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmctl.errors import ModelError
from llmctl.model.check import ModelReport, check_model_dir, expected_tensors
from llmctl.model.weights import iter_weights, read_header
from tests.helpers.cli import run_llmctl
from tests.helpers.tiny_models import TINY_MODELS, make_tiny_model

# kind → transformers config overrides: every kind the engines run, and the bias variants
# each architecture's transformers class has.
VARIANTS = {
    **{kind: (kind, {}) for kind in TINY_MODELS},
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "mistral-attention-bias-ignored": ("mistral", {"attention_bias": True}),
}


def validate_model_dir(path) -> ModelReport:
    """The report of a directory that must have no problems."""
    report = check_model_dir(path)
    assert not report.problems, report.error_message()
    return report


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_checkpoints_have_exactly_the_expected_tensors(tmp_path, variant):
    kind, overrides = VARIANTS[variant]
    model_dir = make_tiny_model(tmp_path, kind, **overrides)
    report = validate_model_dir(model_dir)
    expected = expected_tensors(report.config)
    assert set(report.tensors) == set(expected)
    assert all(report.tensors[name].shape == shape for name, (shape, _) in expected.items())


@pytest.mark.parametrize("kind", ["qwen2", "llama3-rope"])
def test_sharded_checkpoints_from_transformers_pass(tmp_path, tiny_model_dir, kind):
    from tests.helpers.tiny_models import load_hf_model

    load_hf_model(tiny_model_dir(kind)).save_pretrained(
        tmp_path, safe_serialization=True, max_shard_size="40KB"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir(kind) / name, tmp_path / name)
    report = validate_model_dir(tmp_path)
    assert len(report.weight_files) > 2
    assert set(report.tensors) == set(expected_tensors(report.config))


def small_safetensors(path: Path) -> bytes:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=generator),
        "b": torch.randn(7, generator=generator).to(torch.bfloat16),
        "c": torch.randint(0, 9, (2, 2), generator=generator, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return path.read_bytes()


def library_reads(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():
                file.get_tensor(name)
        return True
    except Exception:
        return False


def we_read(path: Path) -> bool:
    try:
        read_header(path)
        return True
    except ModelError:
        return False


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_header_reader_refuses_what_safetensors_refuses(tmp_path, data):
    path = tmp_path / "t.safetensors"
    original = small_safetensors(path)
    (header_len,) = struct.unpack("<Q", original[:8])
    damaged = bytearray(original)
    kind = data.draw(st.sampled_from(["flip", "truncate", "append"]))
    if kind == "flip":  # damage inside the length prefix or the JSON header
        for _ in range(data.draw(st.integers(1, 3))):
            position = data.draw(st.integers(0, 8 + header_len - 1))
            damaged[position] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        damaged = damaged[: data.draw(st.integers(0, len(original) - 1))]
    else:
        damaged += bytes(data.draw(st.integers(1, 64)))
    path.write_bytes(bytes(damaged))
    assert we_read(path) == library_reads(path), bytes(damaged[: 8 + header_len + 8])


def test_the_loaders_name_a_damaged_file_even_without_the_check(tmp_path, stories_dir):
    shutil.copytree(stories_dir, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(weights.read_bytes()[:100_000])
    with pytest.raises(ModelError, match="model.safetensors is truncated: it has 100,000 bytes"):
        next(iter_weights(tmp_path / "m"))


def test_another_architecture_gets_only_the_generic_checks(tmp_path, stories_dir):
    """A model for another engine (a plugin may serve it): no Llama-family rules."""
    shutil.copytree(stories_dir, tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    config.chmod(0o644)
    config.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    report = check_model_dir(tmp_path / "m")
    assert report.problems == [] and report.config is None and len(report.tensors) == 47


def test_models_dir_shows_what_llmctl_reads(stories_dir):
    result = run_llmctl("models", str(stories_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    out = " ".join(result.stdout.split())
    for fact in (
        "LlamaForCausalLM (llama)",
        "5 layers, hidden 64, 8 heads (4 KV heads) of 8, MLP 172, vocab 512, tied embeddings",
        "512 tokens; RoPE theta 10000",
        "float32 (config.json)",
        "47 tensors, 260.0K parameters (47 F32)",
        "tokenizer.json, 512 tokens; BOS '<s>' added; EOS ids [2]",
        "none: chat requests",
        "turbo, torch",
        "No problem found",
    ):
        assert fact in out, result.stdout


def test_models_dir_of_a_broken_model_is_an_error_after_what_it_read(tmp_path, stories_dir):
    shutil.copytree(stories_dir, tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    config.chmod(0o644)
    config.write_text(config.read_text().replace('"vocab_size": 512', '"vocab_size": 640'))
    result = run_llmctl("models", str(tmp_path / "m"))
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert "vocab 640" in result.stdout  # what it read ...
    error = " ".join(result.stderr.split())  # ... then what is wrong, once
    assert error.count("Error:") == 1 and "[640, 64] (vocab_size x hidden_size)" in error


def test_models_lists_a_broken_cached_model_as_broken(tmp_path, stories_dir):
    snapshot = tmp_path / "hub" / "models--tiny--broken" / "snapshots" / "abc"
    shutil.copytree(stories_dir, snapshot)
    (snapshot / "tokenizer.json").unlink()
    result = run_llmctl("models", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "tiny/broken" in line)
    assert "broken" in row.replace("tiny/broken", "") and "llmctl models tiny/broken" in row
