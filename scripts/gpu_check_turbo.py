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
   GPU only).

The decode attention kernel itself is timed beside Triton's in the bandwidth table of
``gpu_check.py``. With ``dry_run`` on a machine without a GPU the "device" is the CPU:
the script's plumbing runs on tiny shapes and the numbers mean nothing.
"""

from __future__ import annotations

import json
import sys
import time
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
    for part in (run_tests, end_to_end, time_decode_step):
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


if __name__ == "__main__":
    import torch
    from gpu_check import run_pytest

    on_gpu = torch.cuda.is_available()
    ok, report = turbo_section("cuda" if on_gpu else "cpu", not on_gpu, run_pytest)
    print(report)
    sys.exit(0 if ok else 1)
