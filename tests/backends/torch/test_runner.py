"""The runner on its own: greedy decoding equals transformers' reference tokens, other
dtypes run and stay close to fp32, and misuse fails clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from llmctl_torch.attention import native_problem
from llmctl_torch.model import TorchModelRunner

from llmctl.engine.runner import StepBatch
from llmctl.errors import ModelError, OptionError
from llmctl.model.config import ModelConfig
from tests.helpers.tiny_models import PagedSequences, greedy


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_greedy_tokens_equal_the_transformers_reference(
    stories_dir, block_size, attention, monkeypatch
):
    """With turbo's native CPU attention (the default where it builds) and plain torch."""
    if attention == "native" and (problem := native_problem()):
        pytest.skip(f"turbo's native ops do not build here: {problem}")
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", attention)
    reference = json.loads((stories_dir / "reference_greedy.json").read_text())
    cases = reference["results"]
    runner = TorchModelRunner(
        stories_dir, ModelConfig.from_dir(stories_dir), block_size=block_size, num_blocks=64
    )
    assert runner.ops.name == attention
    steps = reference["generation"]["max_new_tokens"]
    outputs = greedy(runner, [case["prompt_ids"] for case in cases], steps)
    for case, output in zip(cases, outputs):
        assert output == case["new_token_ids"], case["prompt"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_stays_close_to_fp32(stories_dir, dtype):
    config = ModelConfig.from_dir(stories_dir)
    prompt = json.loads((stories_dir / "reference_greedy.json").read_text())["results"][0]
    ids = prompt["prompt_ids"] + prompt["new_token_ids"][:20]
    logits = {}
    for name in ("float32", dtype):
        runner = TorchModelRunner(stories_dir, config, dtype=name, block_size=16, num_blocks=8)
        assert runner.kv_caches[0][0].dtype == getattr(torch, name)
        paged = PagedSequences(runner)
        paged.add(ids)
        logits[name] = torch.cat(
            [paged.step({0: len(ids) - 3})] + [paged.step({0: 1}) for _ in range(3)]
        )
    assert logits[dtype].dtype == torch.float32
    assert torch.isfinite(logits[dtype]).all()
    # bf16 keeps 8 mantissa bits: errors of about 1% of the logits' range are expected.
    scale = logits["float32"].abs().max()
    assert (logits[dtype] - logits["float32"]).abs().max() < 0.03 * scale
    assert (logits[dtype].argmax(-1) == logits["float32"].argmax(-1)).float().mean() >= 0.75


def test_cache_must_be_allocated_before_execute(stories_dir):
    runner = TorchModelRunner(stories_dir, ModelConfig.from_dir(stories_dir), block_size=16)
    batch = StepBatch([1], [0], [1], [1], [[0]], [0])
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        runner.execute(batch)
    runner.allocate_kv_cache(4)
    assert runner.num_blocks == 4
    assert runner.execute(batch).shape == (1, 512)
    assert runner.kv_bytes_per_block() == 2 * 5 * 4 * 8 * 16 * 4


def test_unknown_dtype_is_refused(stories_dir):
    with pytest.raises(OptionError, match="dtype 'int8'"):
        TorchModelRunner(stories_dir, ModelConfig.from_dir(stories_dir), dtype="int8")


def test_checkpoint_that_does_not_fit_the_config_is_refused(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    config = ModelConfig.from_dir(model_dir)
    wrong_layers = replace(config, num_layers=3)
    with pytest.raises(ModelError, match="missing model.layers.2"):
        TorchModelRunner(model_dir, wrong_layers)
    wrong_width = replace(config, intermediate_size=80)
    with pytest.raises(ModelError, match="shapes do not match"):
        TorchModelRunner(model_dir, wrong_width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_float32_weights_are_packed_for_onednn(stories_dir, dtype, monkeypatch):
    """Without turbo's ops, on the CPU a float32 model's linear weights are packed once
    for oneDNN (opaque, same shape); other dtypes keep theirs as loaded. The LM head is
    not a Linear."""
    from llmctl_torch.linear import Linear

    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "torch")
    runner = TorchModelRunner(
        stories_dir, ModelConfig.from_dir(stories_dir), dtype=dtype, block_size=16, num_blocks=4
    )
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * runner.config.num_layers
    packed = dtype == torch.float32 and torch.backends.mkldnn.is_available()
    assert all(m.weight.is_mkldnn == packed for m in linears)
    assert all(m.weight.shape == (m.out_features, m.in_features) for m in linears)


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_weights_are_packed_for_turbos_kernel_where_its_ops_serve_attention(
    stories_dir, dtype, quantization
):
    """Where turbo's ops build, a float32 or bfloat16 model's linear layers run on turbo's
    ``linear`` kernel: their weights packed into its [panels, in, 16] panels (int8 with
    panel-packed scales under ``quantization=int8``), with the logits of torch's own
    kernels. float16, which turbo's CPU kernels do not compute in, keeps torch's weight
    methods."""
    from llmctl_torch.linear import INT8_WEIGHTS, UNQUANTIZED, Linear, NativeMethod

    if problem := native_problem():
        pytest.skip(f"turbo's native ops do not build here: {problem}")
    config = ModelConfig.from_dir(stories_dir)
    step = StepBatch(list(range(3, 40)), list(range(37)), [37], [37], [[0, 1, 2]], list(range(37)))
    logits = {}
    for kernels in ("torch", "native"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("LLMCTL_TORCH_ATTENTION", kernels)
            runner = TorchModelRunner(
                stories_dir, config, dtype=dtype, quantization=quantization, block_size=16,
                num_blocks=4,
            )  # fmt: skip
        logits[kernels] = runner.execute(step)
    # Rounding apart (the sums run in another order), the same logits; bfloat16 and
    # float16 keep 8 and 11 mantissa bits.
    scale = logits["torch"].abs().max()
    tolerance = 1e-4 if dtype == torch.float32 else 0.03
    assert (logits["native"] - logits["torch"]).abs().max() < tolerance * scale
    assert runner.ops.name == "native"
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    if dtype == torch.float16:
        expected = UNQUANTIZED if quantization == "none" else INT8_WEIGHTS
        assert all(m.method is expected for m in linears)
        return
    assert all(isinstance(m.method, NativeMethod) for m in linears)
    assert {m.method.name for m in linears} == {quantization}
    for m in linears:
        panels = -(-m.out_features // 16)
        assert m.weight.shape == (panels, m.in_features, 16)
        assert m.weight.dtype == (torch.int8 if quantization == "int8" else dtype)
        if quantization == "int8":
            assert m.weight_scale.shape == (panels * 16,)


def test_cpu_steps_run_on_one_thread_but_for_large_products(stories_dir, monkeypatch):
    """A CPU step runs on one torch thread, its torch products of at least
    THREADED_PRODUCT_MACS on the count the caller set, and that count is back after;
    the logits are those of a step on the caller's count throughout."""
    import llmctl_torch.cpu_threads as cpu_threads
    import llmctl_torch.linear as linear

    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "torch")  # torch's products, not turbo's
    runner = TorchModelRunner(
        stories_dir, ModelConfig.from_dir(stories_dir), block_size=16, num_blocks=16
    )
    tokens = 8
    step = StepBatch(list(range(1, tokens + 1)), list(range(tokens)), [tokens], [tokens],
                     [[0]], list(range(tokens)))  # fmt: skip
    seen: list[tuple[str, int]] = []
    forward, onednn = runner.forward, linear._onednn_linear

    def counting_forward(inputs, is_decode):
        seen.append(("step", torch.get_num_threads()))
        return forward(inputs, is_decode)

    def counting_linear(x, weight, bias):
        seen.append((f"product {x.shape[0] * weight.numel()}", torch.get_num_threads()))
        return onednn(x, weight, bias)

    monkeypatch.setattr(runner, "forward", counting_forward)
    monkeypatch.setattr(linear, "_onednn_linear", counting_linear)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = runner.execute(step)
        torch.set_num_threads(2)
        seen.clear()
        # stories260K's products are small: every one on the step's thread ...
        torch.testing.assert_close(runner.execute(step), reference)
        assert {threads for _, threads in seen} == {1}
        assert len(seen) == 1 + 4 * runner.config.num_layers + 1  # the LM head's too
        # ... until they count as large: then on two, the rest of the step on one.
        smallest = min(int(name.split()[1]) for name, _ in seen if name != "step")
        monkeypatch.setattr(cpu_threads, "THREADED_PRODUCT_MACS", smallest)
        seen.clear()
        torch.testing.assert_close(runner.execute(step), reference)
        assert seen[0] == ("step", 1)
        assert {threads for name, threads in seen[1:]} == {2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


SMALL_FIRST_STEP = """
import torch
from llmctl_torch.model import TorchModelRunner
from llmctl_turbo.build import load_ops
from llmctl.engine.runner import StepBatch
from llmctl.model.config import ModelConfig
torch.set_num_threads(2)
runner = TorchModelRunner({model!r}, ModelConfig.from_dir({model!r}), block_size=16, num_blocks=4)
runner.execute(StepBatch([1, 2], [0, 1], [2], [2], [[0]], [0, 1]))
print(runner.ops.name, load_ops().cpu_threads(), torch.get_num_threads())
"""


def test_turbo_threads_start_at_the_full_count_under_a_small_first_step(stories_dir):
    """turbo's attention threads start at their first use; a first step on one torch
    thread must not leave them at one for good."""
    if problem := native_problem():
        pytest.skip(f"turbo's native ops do not build here: {problem}")
    result = subprocess.run(
        [sys.executable, "-c", SMALL_FIRST_STEP.format(model=str(stories_dir))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["native", "2", "2"]
