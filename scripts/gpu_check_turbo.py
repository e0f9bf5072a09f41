"""The turbo section of ``scripts/gpu_check.py``: turbo's CUDA kernels on the GPU machine.

``turbo_section(device, dry_run, run_pytest)`` returns ``(passed, markdown)``:

1. build: turbo's native ops with the CUDA kernels (nvcc, the current GPU's arch);
2. tests: ``tests/backends/turbo/test_cuda_kernels.py`` (every CUDA op against plain
   torch and turbo's CPU op on fresh random inputs: fp32 / bf16 / fp16, block sizes 32
   to 256, GQA 1 / 4 / 8, contexts ending mid-block, split-K; the native step against
   transformers) and ``test_cuda_graphs.py`` (greedy tokens with CUDA graphs = without
   = transformers, preemption, padding), in a child process (``run_pytest``);
3. end to end: stories260K's greedy tokens through the turbo engine on the device,
   against transformers' (``reference_greedy.json``);
4. decode step: the reference Llama (723.6M, bf16) through turbo's runner, eager and as
   the CUDA graphs the runner captured, per batch size (``gpu_check_graphs.compare_steps``;
   GPU only);
5. LoRA: turbo's CUDA LoRA pass (``csrc/cuda/lora.cu``, the op ``lora_add_slots``): a
   mixed batch of four adapters through turbo's CUDA step against transformers + peft
   (``test_lora.py``), then, on the reference Llama's fused layer shapes, the pass against
   plain torch and its µs per call beside the bf16 base matmul it adds to (GPU only).

The decode attention kernel itself is timed beside Triton's in the bandwidth table of
``gpu_check.py``. With ``dry_run`` on a machine without a GPU the "device" is the CPU:
the script's plumbing runs on tiny shapes and the numbers mean nothing.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

from gpu_check_graphs import RunPytest, compare_steps, reference_llama  # scripts/ on sys.path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
TESTS = ["tests/backends/turbo/test_cuda_kernels.py", "tests/backends/turbo/test_cuda_graphs.py"]
STEP_BATCHES, STEP_CONTEXT = (1, 16, 64, 128), 512


def turbo_section(device: str, dry_run: bool, run_pytest: RunPytest) -> tuple[bool, str]:
    lines = ["## 3. Turbo: native CUDA kernels\n"]
    started = time.monotonic()
    try:
        from llmctl_turbo.build import build_spec, load_ops

        load_ops()
        spec = build_spec()
    except Exception as exc:  # a failed build is the finding: report it, skip the rest
        return False, "\n".join(lines) + f"\nbuild FAILED: {exc}\n"
    lines.append(
        f"Built (or loaded) in {time.monotonic() - started:.0f} s: `{spec.library}` "
        f"(CUDA kernels: {'yes, CUDA ' + spec.cuda_version if spec.with_cuda else 'no'}).\n"
    )
    passed = True
    for part in (run_tests, end_to_end, time_decode_step, lora_kernels):
        try:
            ok, text = part(device, dry_run, run_pytest)
        except Exception as exc:  # keep going: the report says what broke
            ok, text = False, f"### {part.__name__}: ERROR\n\n```\n{exc!r}\n```\n"
        passed &= ok
        lines.append(text)
    return passed, "\n".join(lines)


def run_tests(device: str, dry_run: bool, run_pytest: RunPytest) -> tuple[bool, str]:
    # Without a GPU every test here skips: the run shows they are collected.
    return run_pytest("### Tests: CUDA ops and CUDA graphs", ["-rs", *TESTS])


def end_to_end(device: str, dry_run: bool, run_pytest: RunPytest) -> tuple[bool, str]:
    title = "### End to end: stories260K greedy through the turbo engine\n\n"
    if not (STORIES / "reference_greedy.json").is_file():
        return False, title + f"stories260K not found at {STORIES}: not run.\n"
    from llmctl import LLM, SamplingParams

    reference = json.loads((STORIES / "reference_greedy.json").read_text())
    cases = [(r["prompt_ids"], r["new_token_ids"]) for r in reference["results"]]
    if dry_run:
        cases = [(prompt, want[:4]) for prompt, want in cases[:2]]
    started = time.monotonic()
    with LLM(
        str(STORIES),
        backend="turbo",
        device=device,
        dtype="float32",
        cache_block_seq_len=32,
        cache_max_entry_count=64,
    ) as llm:
        outputs = llm.generate(
            [prompt for prompt, _ in cases],
            [SamplingParams(max_tokens=len(want), temperature=0.0) for _, want in cases],
        )
        graphs = llm.engine.engine.runner.decode_graphs
        replays = graphs.replays if graphs is not None else 0
    same = [list(o.token_ids) == list(want) for o, (_, want) in zip(outputs, cases)]
    passed = all(same)
    return passed, (
        title + f"float32, block size 32, {device}, {len(cases)} prompts, "
        f"{time.monotonic() - started:.1f} s, {replays} decode steps from CUDA graphs: "
        f"**{'all tokens match' if passed else 'MISMATCH'}** ({sum(same)}/{len(same)} "
        "identical).\n"
    )


def time_decode_step(device: str, dry_run: bool, run_pytest: RunPytest) -> tuple[bool, str]:
    """turbo's whole decode step (``llama_step``), eager and replayed as the CUDA graphs its
    runner captures for the engine."""
    from llmctl_turbo.runner import TurboModelRunner

    from llmctl.model.config import ModelConfig

    title = "### Decode step on the reference Llama: eager vs CUDA graph\n\n"
    if device != "cuda":
        return True, title + "Not run: CUDA graphs need a GPU (the runner captures none).\n"
    model_dir = reference_llama(tiny=dry_run)
    dtype, block_size = "bfloat16", 64
    config = ModelConfig.from_dir(model_dir)
    num_blocks = max(STEP_BATCHES) * -(-STEP_CONTEXT // block_size)
    started = time.monotonic()
    runner = TurboModelRunner(
        model_dir, config, dtype=dtype, device=device, block_size=block_size,
        num_blocks=num_blocks, max_num_seqs=max(STEP_BATCHES),
    )  # fmt: skip
    graphs, runner.decode_graphs = runner.decode_graphs, None  # execute() now runs eagerly
    setup_seconds = time.monotonic() - started
    passed, rows = compare_steps(runner, graphs, STEP_BATCHES, STEP_CONTEXT, iterations=30)
    del runner, graphs
    import torch

    torch.cuda.empty_cache()
    return passed, (
        title + f"`{model_dir.name}`, {dtype}, block size {block_size}, every sequence at "
        f"context {STEP_CONTEXT}; each step waited for. Loading the model and capturing "
        f"its graphs took {setup_seconds:.1f} s.\n\n"
        "| batch | eager ms/step | graph ms/step | speed-up | graph logits vs eager "
        "(max abs diff / max abs) |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


# The LoRA part: 4 adapters of rank 16 over decode batches (1, 16, 64) and a prompt (256).
LORA_BATCHES, LORA_RANK, LORA_SLOTS = (1, 16, 64, 256), 16, 4
# The reference Llama's fused linears: (in features, output parts).
LORA_LAYERS = {
    "qkv": (2048, [2048, 512, 512]),
    "o_proj": (2048, [2048]),
    "gate_up": (2048, [5632, 5632]),
    "down": (5632, [2048]),
}


def lora_kernels(device: str, dry_run: bool, run_pytest: RunPytest) -> tuple[bool, str]:
    """The LoRA tests on CUDA, then the pass on each layer shape and batch: its error
    against plain torch in float32 and its time beside the base bf16 matmul. The batch's
    rows cycle through the base model and the four adapters ("mixed": no two neighbours
    share a slot, so each reads its own A and B) or come sorted by slot ("grouped", as a
    prompt chunk: each tile of 8 rows reads one slot once)."""
    title = "### LoRA: turbo's CUDA pass (csrc/cuda/lora.cu)\n\n"
    tests_passed, tests = run_pytest(
        "#### Tests: adapters on CUDA",
        ["-rs", "tests/backends/torch/test_lora.py", "-k", "adapters_on_cuda"],
    )
    if device != "cuda":
        return tests_passed, title + tests + "\nTimings not run: the pass runs on CUDA only.\n"
    import torch
    from llmctl_turbo.build import load_ops

    ops = load_ops()
    generator = torch.Generator(device="cuda").manual_seed(0)
    passed, rows = tests_passed, []
    for batch in LORA_BATCHES:
        # Slots 0, 1, 2, 3, then a base row (-1), and again: a batch of 1 has an adapter.
        cycle = torch.arange(batch, device="cuda", dtype=torch.int32) % (LORA_SLOTS + 1)
        cycle[cycle == LORA_SLOTS] = -1
        for pattern, slots in [("mixed", cycle), ("grouped", cycle.sort().values)]:
            for name, (in_features, sizes) in LORA_LAYERS.items():
                error, lora_seconds, base_seconds = time_lora_layer(
                    ops, slots, in_features, sizes, generator
                )
                passed &= error < 1e-2  # bf16 output: one rounding of each sum
                rows.append(
                    f"| {batch} | {pattern} | {name} | {lora_seconds * 1e6:.1f} | "
                    f"{base_seconds * 1e6:.1f} | {lora_seconds / base_seconds:.2f} | {error:.1e} |"
                )
    torch.cuda.empty_cache()
    return passed, (
        title + tests + f"\n{LORA_SLOTS} adapters of rank {LORA_RANK}, bf16 activations, "
        "float32 slots; µs per call (CUDA events over 100 back-to-back calls).\n\n"
        "| rows | slots | layer | LoRA pass µs | base bf16 matmul µs | ratio | max error "
        "/ max |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def time_lora_layer(ops, slots, in_features: int, sizes: list[int], generator, iterations=100):
    """One layer's LoRA pass over ``slots`` rows (on their device): (max error / max
    against plain torch in float32, seconds per call, seconds per call of the base bf16
    matmul)."""
    import torch
    from gpu_check_quant import seconds_per_call  # scripts/ on sys.path

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator, device=slots.device).to(dtype)

    batch, features = len(slots), sum(sizes)
    a = randn(LORA_SLOTS, len(sizes) * LORA_RANK, in_features) / in_features**0.5
    bt = randn(LORA_SLOTS, LORA_RANK, features) / LORA_RANK**0.5
    x = randn(batch, in_features, dtype=torch.bfloat16)
    weight = randn(features, in_features, dtype=torch.bfloat16) / in_features**0.5
    out = x @ weight.T
    offsets = [sum(sizes[:p]) for p in range(len(sizes))]
    got = out.clone()
    ops.lora_add_slots(got, x, a, bt, offsets, sizes, slots)
    want = out.float()
    for slot in range(LORA_SLOTS):
        adapted = slots == slot
        h = x[adapted].float() @ a[slot].T
        for p, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
            part = h[:, p * LORA_RANK : (p + 1) * LORA_RANK]
            want[adapted, offset : offset + size] += part @ bt[slot, :, offset : offset + size]
    error = ((got.float() - want).abs().max() / want.abs().max()).item()
    lora = partial(ops.lora_add_slots, out, x, a, bt, offsets, sizes, slots)
    base = partial(torch.mm, x, weight.T, out=out)
    device = slots.device.type
    return (
        error,
        seconds_per_call(lora, device, iterations),
        seconds_per_call(base, device, iterations),
    )


if __name__ == "__main__":
    import torch
    from gpu_check import run_pytest

    on_gpu = torch.cuda.is_available()
    ok, report = turbo_section("cuda" if on_gpu else "cpu", not on_gpu, run_pytest)
    print(report)
    sys.exit(0 if ok else 1)
