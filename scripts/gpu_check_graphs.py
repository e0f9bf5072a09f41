"""The CUDA-graph section of ``scripts/gpu_check.py``: the torch backend's decode step.

``graphs_section(device, dry_run, run_pytest)`` returns ``(passed, markdown)``
(``run_pytest`` is gpu_check's: pytest in a child process with compiled kernels):

1. tests: ``tests/backends/torch/test_cuda_graphs.py`` (greedy tokens with graphs on =
   graphs off = transformers on stories260K, a random Qwen2 with biases and a random
   Mistral with one KV head; batches of every size from 19 to 1; prefix caching;
   preemption; bf16 logits; verification and LoRA steps on the graphs' buffers) and the
   host-side packing tests, in a child process with the Triton kernels compiled; then
   ``tests/backends/test_cuda_graphs_verify.py``: n-gram speculation (verification
   graphs, k + 1 tokens per sequence) on both backends and a batch mixing LoRA adapters
   on torch, greedy tokens with graphs on = graphs off;
2. decode and verification steps (k + 1 = 4 tokens per sequence): the reference Llama
   shape (723.6M parameters, bf16, every sequence at context 512) through the torch
   runner, eager and as a replayed graph, per batch size: milliseconds per step (inputs staged, model run, device finished: what an
   engine step waits for), the logits of both compared; graph capture time and memory.

``reference_llama()`` makes (once per machine, in the temp dir) the reference model of
the GPU workload; the end-to-end section can share it.

With ``dry_run`` on a machine without a GPU the "device" is the CPU: a tiny model, the
Triton interpreter, graphs replayed eagerly (``replay_eagerly``); numbers mean nothing.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# (section title, pytest arguments, lines of log to keep) -> (passed, markdown)
RunPytest = Callable[..., tuple[bool, str]]
TESTS = ["tests/backends/torch/test_cuda_graphs.py", "tests/engine/test_step_packing.py"]
# Verification steps (n-gram speculation, k + 1 tokens per sequence) and batches mixing
# LoRA adapters: greedy tokens with graphs on = graphs off (= no speculation, = peft).
VERIFY_TESTS = ["tests/backends/test_cuda_graphs_verify.py"]
# The reference model of the GPU workload (docs: DESIGN "How speed work is done here").
REFERENCE_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    vocab_size=512,
    max_position_embeddings=4096,
)
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=512,
    max_position_embeddings=128,
)
STEP_BATCHES = (1, 16, 64, 128)
VERIFY_K = 3  # num_speculative_tokens of the timed verification steps
DRY_RUN_BATCHES = (1, 3)


def graphs_section(device: str, dry_run: bool, run_pytest: RunPytest) -> tuple[bool, str]:
    tests_passed, tests = run_tests(dry_run, run_pytest)
    verify_passed, verify = run_pytest(
        "### Verification and LoRA steps: graphs on vs off", ["-rs", *VERIFY_TESTS]
    )
    step_passed, step = time_decode_step(device, dry_run)
    if device == "cuda":  # the model and its cache are gone: hand their memory back
        import torch

        torch.cuda.empty_cache()
    heading = "## CUDA graphs: the torch backend's decode step\n"
    passed = tests_passed and verify_passed and step_passed
    return passed, "\n".join([heading, tests, verify, step])


def run_tests(dry_run: bool, run_pytest: RunPytest) -> tuple[bool, str]:
    # Without a GPU the gpu tests skip; the interpreted one is left to the timing part.
    selection = ["-rs", *TESTS]
    if dry_run:
        selection += ["-k", "not padded_decode_buffers"]
    return run_pytest("### Tests", selection, tail_lines=20)


def reference_llama(tiny: bool = False) -> Path:
    """The random Llama of the GPU workload (or a tiny one), made once in the temp dir."""
    from make_random_llama import make_random_llama  # scripts/ is on sys.path

    name = "llama-tiny" if tiny else "llama-723m"
    model_dir = Path(tempfile.gettempdir()) / "llmctl_gpu_check" / name
    if not (model_dir / "model.safetensors").is_file():
        make_random_llama(model_dir, **(TINY_SHAPE if tiny else REFERENCE_SHAPE))
    return model_dir


def decode_batch(num_seqs: int, context: int, block_size: int, query_len: int = 1):
    """A decode step of ``num_seqs`` sequences at ``context`` tokens, each over its own
    blocks (every block of sequence ``i`` follows those of ``i - 1``); with ``query_len``
    > 1 a verification step: each sequence's last token and ``query_len - 1``
    proposals, logits at every one of them."""
    from llmctl.engine.runner import StepBatch

    blocks_per_seq = -(-context // block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    new = range(context - query_len, context)
    return StepBatch(
        input_ids=[(7 * i + p) % 500 + 3 for i in range(num_seqs) for p in new],
        positions=[p for _ in range(num_seqs) for p in new],
        query_lens=[query_len] * num_seqs,
        context_lens=[context] * num_seqs,
        block_tables=tables,
        slot_mapping=[
            t[p // block_size] * block_size + p % block_size for t in tables for p in new
        ],
        logits_indices=list(range(num_seqs * query_len)) if query_len > 1 else None,
    )


def time_decode_step(device: str, dry_run: bool) -> tuple[bool, str]:
    import os

    os.environ["LLMCTL_TORCH_ATTENTION"] = "triton"  # graphs need kernels that skip padding
    # First: without a GPU it switches Triton's interpreter on before transformers
    # (making the model) imports triton.
    from llmctl_torch import triton_attention  # noqa: F401
    from llmctl_torch.model import TorchModelRunner

    from llmctl.engine.runner import DecodeGraphs, record_cuda_graph, replay_eagerly
    from llmctl.model.config import ModelConfig

    title = "### Decode and verification steps: eager vs CUDA graph\n\n"
    started = time.monotonic()
    try:
        model_dir = reference_llama(tiny=dry_run)
    except SystemExit as exc:  # make_random_llama's way of saying the tokenizer is missing
        return False, title + f"could not make the model: {exc}\n"
    made = time.monotonic() - started
    batches, context = (DRY_RUN_BATCHES, 32) if dry_run else (STEP_BATCHES, 512)
    iterations = 2 if dry_run else 30
    dtype, block_size = ("float32", 16) if dry_run else ("bfloat16", 64)
    config = ModelConfig.from_dir(model_dir)
    blocks_per_seq = -(-context // block_size)
    num_blocks = max(batches) * blocks_per_seq
    runner = TorchModelRunner(
        model_dir, config, dtype=dtype, device=device, block_size=block_size,
        num_blocks=num_blocks, cuda_graphs=False,
    )  # fmt: skip
    capture_started = time.monotonic()
    graphs = DecodeGraphs(
        runner.decode_step,
        max_batch_size=max(batches),
        max_blocks_per_seq=-(-runner.max_model_len // block_size),
        block_size=block_size,
        num_blocks=num_blocks,
        device=runner.device,
        num_speculative_tokens=VERIFY_K,
        record=record_cuda_graph if device == "cuda" else replay_eagerly,
    )
    graphs.capture(progress=False)
    capture_seconds = time.monotonic() - capture_started

    passed, rows = compare_steps(runner, graphs, batches, context, iterations)
    parameters = sum(p.numel() for p in runner.model.parameters())
    text = (
        title + f"{parameters / 1e6:.1f}M-parameter random Llama (`{model_dir}`, made in "
        f"{made:.0f} s), {dtype}, block size {block_size}, every sequence at context "
        f"{context}; {iterations} steps each, each waited for; verification steps feed "
        f"{VERIFY_K + 1} tokens per sequence (k = {VERIFY_K}). Graphs: "
        f"{len(graphs.buckets)} batch sizes x (decode, verification) captured in "
        f"{capture_seconds:.1f} s, {graphs.memory_bytes / 2**20:.0f} MiB of device memory.\n\n"
        "| step | batch | eager ms/step | graph ms/step | speed-up | graph logits vs eager "
        "(max abs diff / max abs) |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    return passed, text


def compare_steps(runner, graphs, batches, context: int, iterations: int):
    """For each batch size: logits of both paths compared, then each path timed."""
    import torch

    on_cuda = runner.device.type == "cuda"
    tolerance = 1e-4 if runner.dtype == torch.float32 else 0.03

    def per_step(fn) -> float:
        """Milliseconds per call, each waited for (as an engine step waits for logits)."""
        for _ in range(3):
            fn()
        sync = torch.cuda.synchronize if on_cuda else (lambda: None)
        sync()
        begin = time.perf_counter()
        for _ in range(iterations):
            fn()
            sync()
        return (time.perf_counter() - begin) / iterations * 1e3

    rows, passed = [], True
    with torch.inference_mode():
        for num_seqs, query_len in [(b, q) for q in (1, VERIFY_K + 1) for b in batches]:
            batch = decode_batch(num_seqs, context, runner.block_size, query_len)

            def eager(batch=batch):
                return runner.execute(batch)  # the runner runs eagerly (its graphs are off)

            def graphed(batch=batch):
                return graphs.run(batch)

            want, got = eager().clone(), graphed().clone()
            # Padding changes matmul shapes: bf16 rounding may differ, nothing more.
            error = ((got - want).abs().max() / want.abs().max()).item()
            same_argmax = bool((got.argmax(-1) == want.argmax(-1)).all())
            close = error < tolerance
            passed &= close
            eager_ms, graph_ms = per_step(eager), per_step(graphed)
            kind = "decode" if query_len == 1 else "verify"
            rows.append(
                f"| {kind} | {num_seqs} | {eager_ms:.2f} | {graph_ms:.2f} | {eager_ms / graph_ms:.1f}x | "
                f"{error:.1e} {'ok' if close else 'TOO FAR'}, argmax "
                f"{'same' if same_argmax else 'differs'} |"
            )
    return passed, rows
