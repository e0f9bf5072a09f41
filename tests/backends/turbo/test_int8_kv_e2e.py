"""turbo with kv_cache_dtype=int8 on the CPU, end to end on stories260K, against the torch
backend's int8 cache (the same quantization, ``llmctl.engine.quant.quantize_kv``, so both
hold the same cache bytes), and turbo's rule for the option.

With float32 activations the two backends differ only in float32 rounding (their
kernels sum in different orders; turbo folds each cache row's scale into its score and
softmax weight, torch dequantizes the rows first). Before quantizing, such a difference
can move a K or V value across a rounding boundary: one int8 step, 1/127 of its row's
largest value, which the measured logits show as a few 1e-3. So greedy tokens must be
equal and teacher-forced log-probabilities agree to 1e-2. With int8 weights too, torch's CPU int8 matmul rounds some decode activations to
bfloat16 (see test_int8_e2e.py): tokens equal, log-probabilities to 2e-2.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from llmctl import LLM, SamplingParams
from llmctl.backend import Hardware
from llmctl.bench.quality import PROMPTS, score
from llmctl.selection import installed_backends
from tests.conftest import STORIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = Hardware(cxx_compiler="/usr/bin/c++", cpu_count=2, memory_bytes=2**34)
HOPPER = replace(CPU, cuda_available=True, compute_capability=(9, 0))
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(turbo_ops):
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    with LLM(str(STORIES), backend="turbo", device="cpu") as llm:
        return [llm.engine.tokenizer.encode(p) for p in PROMPTS[:6]]


def run(backend: str, prompts, kv_cache_dtype="int8", quantization="none", continuations=None):
    """Greedy continuations, the teacher-forced scores of ``continuations`` (default: the
    greedy ones), and the runner's bytes per KV block."""
    with LLM(
        str(STORIES),
        backend=backend,
        device="cpu",
        dtype="float32",
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,  # score() writes cache blocks directly
    ) as llm:
        greedy = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        runner = llm.engine.engine.runner
        forced = continuations or greedy
        scored = score(runner, [p + c for p, c in zip(prompts, forced)], [len(p) for p in prompts])
        return greedy, scored, runner.kv_bytes_per_block()


def assert_close(ours, theirs, tolerance: float) -> None:
    for a, b in zip(ours, theirs):
        assert a.top_tokens == b.top_tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tolerance


def test_turbo_int8_cache_matches_the_torch_backend(prompts, caplog):
    with caplog.at_level(logging.INFO, logger="llmctl"):
        turbo_tokens, turbo_scored, turbo_block = run("turbo", prompts)
    torch_tokens, torch_scored, torch_block = run("torch", prompts, continuations=turbo_tokens)
    assert turbo_tokens == torch_tokens
    assert_close(turbo_scored, torch_scored, 1e-2)
    # One block: int8 elements and a float32 scale per token and kv head, as torch sizes it,
    # and the KV line says so.
    assert turbo_block == torch_block
    _, _, fp32_block = run("turbo", prompts[:1], kv_cache_dtype="auto")
    # stories260K's heads are 8 wide: 8 int8 + a 4-byte scale per row, 32 bytes in float32.
    assert turbo_block * 32 == fp32_block * 12
    assert "(int8 + scales" in caplog.text


def test_turbo_int8_weights_and_cache_follow_the_torch_backend(prompts):
    """Both int8 together: torch's bfloat16 rounding of decode activations moves K and V
    by up to bf16's 4e-3 before they are quantized, so many cache values land one int8
    step apart and a near-tie can break (measured: one teacher-forced step in 192 with a
    different top token, log-probabilities 7e-3 apart at the median, 0.15 at most). The
    comparison is therefore teacher-forced on turbo's tokens, with those tolerances."""
    turbo_tokens, turbo_scored, _ = run("turbo", prompts, quantization="int8")
    _, torch_scored, _ = run("torch", prompts, quantization="int8", continuations=turbo_tokens)
    pairs = [
        (a == b, abs(x - y))
        for ours, theirs in zip(turbo_scored, torch_scored)
        for a, b, x, y in zip(ours.top_tokens, theirs.top_tokens, ours.logprobs, theirs.logprobs)
    ]
    assert sum(same for same, _ in pairs) / len(pairs) >= 0.97
    gaps = sorted(gap for _, gap in pairs)
    assert gaps[len(gaps) // 2] < 2e-2 and gaps[-1] < 0.3


def test_the_rule_takes_an_int8_cache_on_cpu_and_cuda_and_refuses_fp8():
    turbo = installed_backends()["turbo"]
    for hardware in (CPU, HOPPER):
        for device in ("auto", "cpu"):
            options = {"kv_cache_dtype": "int8", "device": device}
            assert turbo.option_errors(options, hardware) == {}
    for hardware in (CPU, HOPPER):
        errors = turbo.option_errors({"kv_cache_dtype": "fp8", "device": "auto"}, hardware)
        assert "turbo has no fp8 KV-cache kernels" in errors["kv_cache_dtype"]
