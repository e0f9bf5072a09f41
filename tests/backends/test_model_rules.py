"""Model capability rules (``ModelRule``), checked in ``Backend.check`` before anything loads.

Llama checkpoints with ``attention_bias`` (q/k/v and o biases) and ``mlp_bias`` (gate/up/
down biases), made by transformers with random weights: the torch backend serves both
with transformers' greedy tokens; turbo serves the attention biases and refuses the MLP
biases in ``check``, so ``--backend auto`` falls back to torch and ``backends check`` says
why.
"""

from __future__ import annotations

import pytest
from llmctl_torch.plugin import TorchBackend
from llmctl_turbo.plugin import TurboBackend

from llmctl import LLM, SamplingParams
from llmctl.hardware import Hardware
from llmctl.model.info import resolve_model
from llmctl.selection import assess, choose
from tests.helpers.cli import run_llmctl
from tests.helpers.tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BIAS_KINDS = ["llama-attention-bias", "llama-mlp-bias"]
CPU = {"device": "cpu", "dtype": "float32"}
TURBO_MLP_REASON = "turbo does not support MLP biases (mlp_bias: true)"


@pytest.mark.parametrize("kind", BIAS_KINDS)
def test_torch_backend_serves_llama_biases_with_transformers_greedy_tokens(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    prompts = [[1, 17, 300, 42, 5], [1, 250], [1, 9, 9, 480, 33, 101, 7, 64]]
    expected = hf_greedy(load_hf_model(model_dir), prompts, 16)
    with LLM(str(model_dir), backend="torch", cache_block_seq_len=16, **CPU) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outputs] == expected


def check_reasons(backend, model_dir) -> list[str]:
    """``backend.check`` with every option resolved (defaults, CPU), as selection calls it."""
    return assess(backend, resolve_model(str(model_dir)), CPU, None, Hardware.probe()).reasons


def test_turbo_refuses_mlp_biases_in_check_and_torch_accepts_them(tiny_model_dir):
    mlp = tiny_model_dir("llama-mlp-bias")
    assert any(TURBO_MLP_REASON in r for r in check_reasons(TurboBackend(), mlp))
    assert not any("bias" in r for r in check_reasons(TorchBackend(), mlp))
    attention = tiny_model_dir("llama-attention-bias")
    assert not any("bias" in r for r in check_reasons(TurboBackend(), attention))


@pytest.mark.parametrize("kind", BIAS_KINDS)
def test_auto_picks_a_backend_that_serves_the_biases(tiny_model_dir, kind):
    hardware = Hardware.probe()
    choice = choose(resolve_model(str(tiny_model_dir(kind))), {**CPU}, hardware=hardware)
    turbo_runs_here = not TurboBackend().check_hardware(hardware)
    if kind == "llama-mlp-bias":
        assert choice.backend.name == "torch"
        if turbo_runs_here:  # skipped for the model, not for the machine
            (skipped,) = [s for s in choice.skipped if s.backend.name == "turbo"]
            assert any(TURBO_MLP_REASON in r for r in skipped.reasons)
    else:
        assert choice.backend.name == ("turbo" if turbo_runs_here else "torch")


def test_backends_check_lists_turbos_reason(tiny_model_dir):
    model_dir = tiny_model_dir("llama-mlp-bias")
    result = run_llmctl("backends", "check", str(model_dir), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "✗ turbo" in out and TURBO_MLP_REASON in out, out
    assert "✓ torch" in out and "would pick torch" in out, out
