"""turbo with quantization=int8 on the CPU, end to end, against the torch backend's int8
path (the same quantization, ``llmctl.engine.quant``), and turbo's rule for the option
(CUDA's int8 kernel is checked by test_cuda_emulated.py here, scripts/gpu_check_quant.py
on a GPU).

torch's int8 path on the CPU rounds decode activations to bfloat16 for some products
(``llmctl_torch.linear._cpu_int8_matmul``) where turbo keeps float32, so logits agree
closely rather than exactly; greedy tokens must be equal.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest

from llmctl import LLM, SamplingParams
from llmctl.backend import Hardware
from llmctl.bench.quality import PROMPTS, score
from llmctl.selection import installed_backends
from tests.conftest import STORIES
from tests.helpers.cli import run_llmctl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = Hardware(cxx_compiler="/usr/bin/c++", cpu_count=2, memory_bytes=2**34)
HOPPER = replace(CPU, cuda_available=True, compute_capability=(9, 0))
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def open_llm(backend: str, quantization: str, dtype: str = "float32") -> LLM:
    return LLM(
        str(STORIES),
        backend=backend,
        device="cpu",
        dtype=dtype,
        quantization=quantization,
        enable_prefix_caching=False,  # score() writes cache blocks directly
    )


@pytest.fixture(scope="module")
def prompts(turbo_ops):
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    with open_llm("turbo", "none") as llm:
        return [llm.engine.tokenizer.encode(p) for p in PROMPTS[:6]]


def greedy_and_scores(
    backend: str, quantization: str, prompts, continuations=None, dtype: str = "float32"
):
    """Greedy continuations of ``prompts``, and the teacher-forced log-probabilities of
    ``continuations`` (default: the greedy ones) after them."""
    with open_llm(backend, quantization, dtype) as llm:
        greedy = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        runner = llm.engine.engine.runner
        forced = continuations or greedy
        scored = score(runner, [p + c for p, c in zip(prompts, forced)], [len(p) for p in prompts])
        return greedy, scored, runner.weight_bytes()


def test_turbo_int8_matches_the_torch_backend_int8(prompts, caplog):
    with caplog.at_level(logging.INFO, logger="llmctl"):
        turbo_tokens, turbo_scored, turbo_bytes = greedy_and_scores("turbo", "int8", prompts)
    torch_tokens, torch_scored, _ = greedy_and_scores("torch", "int8", prompts, turbo_tokens)
    assert turbo_tokens == torch_tokens
    # Teacher-forced on the same tokens, both pick the same top token at every step and
    # give the followed token nearly the same log-probability.
    for ours, theirs in zip(turbo_scored, torch_scored):
        assert ours.top_tokens == theirs.top_tokens
        assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs)) < 2e-2
    # What quantizing saved is logged, as the torch backend logs it (its layers are fused
    # too: qkv, o, gate_up and down in each of 5).
    assert "quantization: 20 linear layers quantized to int8" in caplog.text
    _, _, fp32_bytes = greedy_and_scores("turbo", "none", prompts[:1])
    assert turbo_bytes < fp32_bytes


def test_turbo_int8_stays_close_to_turbo_fp32(prompts):
    """Quantizing moves the model a little, not a lot: the same greedy steps for most of
    each continuation, and the log-probabilities of fp32's own tokens close."""
    fp32_tokens, fp32_scored, _ = greedy_and_scores("turbo", "none", prompts)
    _, int8_scored, _ = greedy_and_scores("turbo", "int8", prompts, fp32_tokens)
    agree = sum(
        top == want
        for scored, tokens in zip(int8_scored, fp32_tokens)
        for top, want in zip(scored.top_tokens, tokens)
    )
    assert agree / sum(map(len, fp32_tokens)) >= 0.9

    def perplexity(scored):
        logprobs = [lp for s in scored for lp in s.logprobs]
        return math.exp(-sum(logprobs) / len(logprobs))

    assert abs(perplexity(int8_scored) / perplexity(fp32_scored) - 1) < 0.05


def test_turbo_int8_runs_bfloat16_activations(prompts):
    """bf16 activations over int8 weights: the fp32-activation model's tokens, teacher
    forced, mostly keep their top rank (bf16 rounds each layer's outputs to 8 bits)."""
    fp32_tokens, fp32_scored, _ = greedy_and_scores("turbo", "int8", prompts)
    _, bf16_scored, _ = greedy_and_scores("turbo", "int8", prompts, fp32_tokens, "bfloat16")
    agree = sum(
        a == b
        for ours, theirs in zip(bf16_scored, fp32_scored)
        for a, b in zip(ours.top_tokens, theirs.top_tokens)
    )
    assert agree / sum(map(len, fp32_tokens)) >= 0.9


def test_the_rule_takes_int8_on_cpu_and_cuda_but_not_fp16_on_cpu():
    turbo = installed_backends()["turbo"]
    assert turbo.option_errors({"quantization": "int8", "device": "auto"}, CPU) == {}
    assert turbo.option_errors({"quantization": "int8", "device": "auto"}, HOPPER) == {}
    fp16 = {"quantization": "int8", "dtype": "float16"}
    assert turbo.option_errors({**fp16, "device": "auto"}, HOPPER) == {}  # the CUDA kernel
    assert turbo.option_errors({**fp16, "device": "cpu"}, HOPPER) != {}
    errors = turbo.option_errors(fp16, CPU)
    assert "float32 or bfloat16" in errors["quantization"]
    # An int8 KV cache beside int8 weights on CUDA too (the SIMT attention kernel).
    both = {"quantization": "int8", "kv_cache_dtype": "int8", "device": "auto"}
    assert turbo.option_errors(both, HOPPER) == {}


def test_backends_check_shows_turbo_serving_int8_on_cpu(tmp_path):
    result = run_llmctl(
        "backends", "check", "demo", "--quantization", "int8", "--device", "cpu", cwd=tmp_path
    )
    out = " ".join(result.stdout.split())
    assert result.returncode == 0, out + result.stderr
    assert "✓ turbo can serve" in out
    assert "auto would pick turbo" in out
