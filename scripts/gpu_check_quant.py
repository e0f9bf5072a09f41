"""The quantization section of ``scripts/gpu_check.py``: int8 weights, int8 / fp8 KV cache,
GGUF blocks on turbo's CUDA kernel.

``quant_section(device, dry_run, env)`` returns ``(passed, markdown)``:

1. kernel tests: the int8 GEMM, and the model with an int8 cache through the Triton
   kernels (the quantized-cache kernel tests, fp8 included on compute capability >= 8.9,
   are in ``test_triton_kernels.py``, which part 1 of ``gpu_check.py`` runs);
2. int8 GEMM timing: the Triton kernel beside bf16 ``F.linear`` (cuBLAS) on the
   layer shapes of the 723.6M reference Llama, for decode (1, 16 rows) and prefill (256);
3. decode attention timing over a bf16, an int8 and an fp8 cache;
4. end to end: ``llmctl bench quality`` on stories260K on the device, each variant
   against float32 (teacher-forced agreement and perplexity are checked, as in
   tests/backends/torch/test_quant_e2e.py; fp8 is reported, not checked);
5. turbo's CUDA int8 weights (csrc/cuda/int8_linear.cu) and int8 KV cache (the SIMT
   attention kernel): ``bench quality`` on stories260K through turbo, int8 weights, int8
   cache and both against float32 (checked as in 4) and against bfloat16 (reported), then decode tokens/s of the 723.6M reference Llama at batch 1 and 16 as
   turbo's CUDA graphs replay it, bfloat16 weights beside int8 ones in the same run;
6. turbo's CUDA GGUF kernel (csrc/cuda/gguf_linear.cu, quantization=gguf): its GPU tests,
   then µs per call of the decode GEMV for Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K on the
   reference Llama's layer shapes beside bf16 ``F.linear`` on the dequantized-size matrix
   (the dense baseline), and decode tokens/s of SmolLM2-135M Q4_1 (the default model's
   file) through turbo's CUDA graphs, its blocks beside the same file dequantized to
   bfloat16. About a minute once turbo is built; ``--part turbo_gguf`` runs it alone.

With ``dry_run`` on a machine without a GPU the device is the CPU, the kernels run
through the Triton interpreter on tiny shapes and the numbers mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
TEXT = REPO / "tests" / "data" / "stories260K_quality_text.json"
# (name, out_features, in_features) of the 723.6M reference Llama's layers (hidden 2048,
# intermediate 5632, 32 heads of 64, 8 KV heads).
GEMM_SHAPES = (
    ("qkv", 3072, 2048),
    ("o", 2048, 2048),
    ("gate_up", 11264, 2048),
    ("down", 2048, 5632),
)
DRY_RUN_GEMM_SHAPES = (("qkv", 48, 32),)
GEMM_ROWS, DRY_RUN_GEMM_ROWS = (1, 16, 256), (1,)
VARIANTS = [
    {"quantization": "int8", "kv_cache_dtype": "auto"},
    {"quantization": "none", "kv_cache_dtype": "int8"},
    {"quantization": "int8", "kv_cache_dtype": "int8"},
    {"quantization": "none", "kv_cache_dtype": "fp8"},
]
TEACHER_FORCED_MIN = (0.95, 0.95, 0.90, None)


def seconds_per_call(fn, device: str, iterations: int) -> float:
    """Mean seconds per call of ``fn`` after a warm-up: CUDA events around back-to-back
    calls on a GPU, the wall clock elsewhere."""
    import torch

    for _ in range(3):
        fn()
    if device != "cuda":
        begin = time.perf_counter()
        for _ in range(iterations):
            fn()
        return (time.perf_counter() - begin) / iterations
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iterations


def quant_section(device: str, dry_run: bool, env: dict[str, str], parts=None) -> tuple[bool, str]:
    lines = ["## Quantization: int8 weights, int8 / fp8 KV cache, GGUF blocks\n"]
    passed = True
    for part in parts or PARTS:
        try:
            ok, text = part(device, dry_run, env)
        except Exception as exc:  # keep going: the report should say what broke
            ok, text = False, f"### {part.__name__}\n\n**ERROR**: {type(exc).__name__}: {exc}\n"
        passed &= ok
        lines.append(text)
    return passed, "\n".join(lines)


def run_tests(device: str, dry_run: bool, env: dict[str, str]) -> tuple[bool, str]:
    tests = "tests/backends/torch/"
    if dry_run:
        selection = [tests + "test_int8_linear.py", "-k", "triton and 1-48-40"]
    else:  # the quantized-cache kernel tests run with the others, in part 1
        selection = [tests + "test_int8_linear.py", tests + "test_triton_e2e.py", "-k", "int8"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    passed = done.returncode == 0
    return passed, (
        f"### Kernel tests\n\n`{' '.join(command[3:])}`: **{'passed' if passed else 'FAILED'}** "
        f"in {time.monotonic() - started:.0f} s\n\n```\n{tail}\n```\n"
    )


def time_gemm(device: str, dry_run: bool, env: dict[str, str]) -> tuple[bool, str]:
    import torch
    import torch.nn.functional as F
    from llmctl_torch.triton_int8_linear import int8_linear

    from llmctl.engine.quant import quantize_weight_int8

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    iterations = 2 if dry_run else 50
    rows = []
    for name, out_features, in_features in DRY_RUN_GEMM_SHAPES if dry_run else GEMM_SHAPES:
        weight = torch.randn(out_features, in_features, device=device, dtype=dtype)
        qweight, scale = quantize_weight_int8(weight)
        for count in DRY_RUN_GEMM_ROWS if dry_run else GEMM_ROWS:
            x = torch.randn(count, in_features, device=device, dtype=dtype)
            dense = seconds_per_call(partial(F.linear, x, weight), device, iterations)
            int8 = seconds_per_call(partial(int8_linear, x, qweight, scale), device, iterations)
            rows.append(
                f"| {name} {out_features}x{in_features} | {count} | {dense * 1e6:.1f} | "
                f"{int8 * 1e6:.1f} | {dense / int8:.2f} | {qweight.numel() / int8 / 1e9:.0f} |"
            )
    return True, (
        f"### int8 GEMM timing\n\n{str(dtype).removeprefix('torch.')} activations, CUDA events "
        "over plain launches. Speed-up > 1: int8 is faster than the dense product.\n\n"
        "| layer | rows | dense µs | int8 µs | speed-up | int8 weight GB/s |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def time_attention(device: str, dry_run: bool, env: dict[str, str]) -> tuple[bool, str]:
    import torch
    from llmctl_torch.triton_attention import paged_decode_attention

    from llmctl.engine.quant import quantize_kv

    heads, kv_heads, head_dim = (4, 2, 32) if dry_run else (32, 8, 128)
    batch, context, block_size = (2, 64, 16) if dry_run else (64, 4096, 64)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    blocks = batch * context // block_size
    shape = (blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, dtype=dtype, device=device)
    v = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(blocks, device=device).view(batch, -1).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    caches = [("model dtype", k, v, None)]
    fp8 = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    for kv_dtype in [torch.int8] + ([torch.float8_e4m3fn] if fp8 else []):
        (kq, ks), (vq, vs) = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
        caches.append((str(kv_dtype).removeprefix("torch."), kq, vq, (ks, vs)))
    rows, base = [], None
    for name, k_cache, v_cache, scales in caches:
        decode = partial(
            paged_decode_attention, q, k_cache, v_cache, tables, lens, head_dim**-0.5,
            kv_scales=scales,
        )  # fmt: skip
        seconds = seconds_per_call(decode, device, 2 if dry_run else 50)
        base = base or seconds
        moved = 2 * k_cache.numel() * k_cache.element_size()
        moved += 0 if scales is None else 2 * scales[0].numel() * 4
        rows.append(
            f"| {name} | {seconds * 1e6:.1f} | {base / seconds:.2f} | {moved / seconds / 1e9:.0f} |"
        )
    return True, (
        f"### Decode attention over a quantized cache\n\nbatch {batch}, context {context}, "
        f"block size {block_size}, {heads} query / {kv_heads} KV heads of {head_dim}, "
        f"{str(dtype).removeprefix('torch.')} queries. GB/s: cache bytes read (scales "
        "included) per second.\n\n| cache | µs | speed-up | GB/s |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )


def quality(device: str, dry_run: bool, env: dict[str, str]) -> tuple[bool, str]:
    from llmctl.bench.quality import QualitySpec, benchmark_quality
    from llmctl.bench.report import markdown, quality_table

    title = "### End to end: `bench quality` on stories260K\n\n"
    if not (STORIES / "config.json").is_file():
        return False, title + f"stories260K not found at {STORIES}: not run.\n"
    text = json.loads(TEXT.read_text())["token_ids"]
    spec = QualitySpec(text_token_ids=tuple(text))
    variants = VARIANTS if device == "cuda" and not dry_run else VARIANTS[:1]
    if dry_run:
        spec = QualitySpec(num_prompts=2, max_tokens=4, text_token_ids=tuple(text[:16]))
    flags = {"backend": "torch", "device": device, "dtype": "float32"}
    started = time.monotonic()
    report = benchmark_quality(str(STORIES), flags, spec, variants=variants)
    passed = dry_run or quality_met(report, TEACHER_FORCED_MIN)
    return passed, (
        title + f"float32 on {device}, {time.monotonic() - started:.0f} s; checked: "
        "teacher-forced agreement >= 95 % / 95 % / 90 % and perplexity within 2 % "
        f"(fp8 reported only): **{'met' if passed else 'NOT MET'}**.\n\n"
        + markdown(quality_table(report))
        + "\n"
    )


def quality_met(report: dict, minimums) -> bool:
    """Each checked run's teacher-forced agreement and perplexity (within 2 %)."""
    return all(
        minimum is None
        or (
            run["teacher_forced_agreement"] >= minimum
            and abs(run["ratios"]["perplexity"] - 1) <= 0.02
        )
        for run, minimum in zip(report["runs"], minimums)
    )


TURBO_DECODE_BATCHES, TURBO_DECODE_CONTEXT = (1, 16), 512


def turbo_int8(device: str, dry_run: bool, env: dict[str, str]) -> tuple[bool, str]:
    """turbo's CUDA int8 weights and int8 KV cache: quality on stories260K, then decode
    speed (int8 weights)."""
    from llmctl.bench.quality import QualitySpec, benchmark_quality
    from llmctl.bench.report import markdown, quality_table

    title = "### turbo: int8 weights and int8 KV cache on CUDA\n\n"
    if device != "cuda":
        return True, title + "Not run: turbo's CUDA kernels need a GPU.\n"
    if not (STORIES / "config.json").is_file():
        return False, title + f"stories260K not found at {STORIES}: not run.\n"
    text = json.loads(TEXT.read_text())["token_ids"]
    spec = QualitySpec(text_token_ids=tuple(text))
    int8 = VARIANTS[:3]  # int8 weights, int8 cache, both
    tables, passed = [], True
    for dtype in ("float32", "bfloat16"):
        flags = {"backend": "turbo", "device": device, "dtype": dtype}
        report = benchmark_quality(str(STORIES), flags, spec, variants=int8)
        if dtype == "float32":  # bf16's own rounding is the larger error: reported only
            passed = quality_met(report, TEACHER_FORCED_MIN[:3])
        tables.append(f"int8 vs {dtype}:\n\n" + markdown(quality_table(report)))
    speed_ok, speed = turbo_decode_speed(device)
    return passed and speed_ok, (
        title + "stories260K, `bench quality` through turbo on the GPU; checked vs float32: "
        "teacher-forced agreement >= 95 % / 95 % / 90 % and perplexity within 2 %: "
        f"**{'met' if passed else 'NOT MET'}**.\n\n" + "\n\n".join(tables) + "\n\n" + speed
    )


def decode_speeds(model_dir: Path, quantizations, batches) -> dict:
    """(quantization, batch size) -> (logits, seconds per decode step, weight bytes) of
    turbo's runner on the GPU, bf16 activations, its CUDA graphs replaying each step."""
    import torch
    from gpu_check_graphs import decode_batch
    from llmctl_turbo.runner import TurboModelRunner

    from llmctl.model.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    block_size = 64
    num_blocks = max(batches) * -(-TURBO_DECODE_CONTEXT // block_size)
    results = {}
    for quantization in quantizations:
        runner = TurboModelRunner(
            model_dir, config, dtype="bfloat16", device="cuda", block_size=block_size,
            num_blocks=num_blocks, max_num_seqs=max(batches), quantization=quantization,
        )  # fmt: skip
        for num_seqs in batches:
            batch = decode_batch(num_seqs, TURBO_DECODE_CONTEXT, block_size)
            with torch.inference_mode():
                logits = runner.execute(batch).clone()
                seconds = seconds_per_call(partial(runner.execute, batch), "cuda", 30)
            results[quantization, num_seqs] = (logits, seconds, runner.weight_bytes())
        del runner
        torch.cuda.empty_cache()
    return results


def turbo_decode_speed(device: str) -> tuple[bool, str]:
    """Decode steps of the reference Llama replayed as turbo's CUDA graphs, bf16 weights
    and int8 weights (bf16 activations); int8's logits against bf16's on the same batch."""
    from gpu_check_graphs import reference_llama

    model_dir = reference_llama()
    results = decode_speeds(model_dir, ("none", "int8"), TURBO_DECODE_BATCHES)
    rows, passed = [], True
    for num_seqs in TURBO_DECODE_BATCHES:
        (want, dense, _), (got, quantized, _) = results["none", num_seqs], results["int8", num_seqs]
        error = ((got - want).abs().max() / want.abs().max()).item()
        passed &= error < 0.1  # int8 weights: per-channel rounding of every layer
        rows.append(
            f"| {num_seqs} | {num_seqs / dense:.0f} | {num_seqs / quantized:.0f} | "
            f"{dense / quantized:.2f} | {error:.1e} |"
        )
    return passed, (
        f"`{model_dir.name}`, bf16 activations, context {TURBO_DECODE_CONTEXT}, CUDA graphs "
        "(the runner's), CUDA events over 30 back-to-back steps. Logits error: max abs diff / max abs "
        "of int8's logits vs bf16's (checked < 0.1).\n\n| batch | bf16 tok/s | int8 tok/s "
        "| speed-up | logits error |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the fp16 scales in each type's block: with those set to finite values,
# random bytes are a valid block (the kernel's speed does not depend on the values).
GGUF_SCALE_OFFSETS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)
}  # fmt: skip
GGUF_ROWS, DRY_RUN_GGUF_ROWS = (1, 4, 16), (1,)
DRY_RUN_GGUF_SHAPES = (("qkv", 24, 256),)
GGUF_DECODE_BATCHES = (1, 16)


def turbo_gguf(device: str, dry_run: bool, env: dict[str, str]) -> tuple[bool, str]:
    """turbo's CUDA GGUF kernel: its tests, its µs per call beside the dense product, and
    SmolLM2 Q4_1 decode tokens/s. Without a GPU (dry run): the emulated kernel's tests and
    a timing of the emulator (meaningless numbers, the table's code checked)."""
    title = "### turbo: GGUF blocks on CUDA (quantization=gguf)\n\n"
    if dry_run:
        selection = ["tests/backends/turbo/test_cuda_emulated.py", "-k", "gguf and Q4_K"]
    else:
        # The GGUF tests of the first file, the GPU ones of the second (its emulated ones
        # ran where there is no GPU).
        selection = [
            "tests/backends/turbo/test_cuda_kernels.py", "tests/gguf/test_turbo_gguf_cuda.py",
            "-k", "gguf and not placed_layers",
        ]  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
    passed = done.returncode == 0
    text = (
        title + f"`{' '.join(command[3:])}`: **{'passed' if passed else 'FAILED'}** in "
        f"{time.monotonic() - started:.0f} s\n\n```\n{tail}\n```\n\n"
        + time_gguf_gemv(device, dry_run)
    )
    if device != "cuda":
        return passed, text + "\nDecode tokens/s: not run (needs a GPU).\n"
    speed_ok, speed = turbo_gguf_decode_speed(device)
    return passed and speed_ok, text + "\n" + speed


def random_gguf_blocks(name: str, features: int, in_features: int, device: str):
    """Random ``name`` blocks ``[features, blocks, block bytes]`` (finite fp16 scales)."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    shape = (features, in_features // weights)
    blocks = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, device=device)
    for offset in GGUF_SCALE_OFFSETS[name]:
        scale = (torch.randn(shape, device=device) / 64).half()
        blocks[:, :, offset : offset + 2] = scale.view(torch.uint8).view(*shape, 2)
    return blocks


# Weight bytes each timing cycles through: over twice the H200's 50 MB L2, so every
# product reads its weight from HBM, as a decode step's layers do.
GGUF_TIMING_BYTES = 128 << 20


def copies(nbytes: int, dry_run: bool) -> int:
    """How many copies of a weight of ``nbytes`` a timing cycles through."""
    return 1 if dry_run else -(-GGUF_TIMING_BYTES // nbytes)


def graphed_seconds_per_call(calls, replays: int = 5) -> float:
    """Mean seconds per call of ``calls`` (run in turn), captured once as a CUDA graph and
    replayed: the kernels' time without the host's launch overhead, which is larger than
    a small GEMV."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuBLAS picks its kernels) off the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return seconds_per_call(graph.replay, "cuda", replays) / len(calls)


def time_gguf_gemv(device: str, dry_run: bool) -> str:
    """µs per call of the GGUF GEMV (turbo's linear op on GGUF rows) beside bf16
    ``F.linear`` (cuBLAS) on dense matrices of the same shape: the product a backend that
    dequantizes at load runs. Both cycle through copies of their weight larger than the
    L2 together, inside one CUDA graph. Without a GPU the emulated kernel stands in, timed
    on the wall clock."""
    import torch
    import torch.nn.functional as F
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        from llmctl_turbo.build import load_ops

        linear, no_bias = load_ops().linear, torch.empty(0, device=device, dtype=dtype)
        gemv = lambda out, x, blocks, name: linear(out, x, blocks, no_bias, None)  # noqa: E731
        timed = graphed_seconds_per_call
    else:
        sys.path.insert(0, str(REPO))
        from tests.backends.turbo.cuda_emulator import library

        emulated = library.load()
        gemv = lambda out, x, blocks, name: emulated.gguf_linear(  # noqa: E731
            out, x, blocks.flatten(1), GGMLQuantizationType[name].value
        )
        timed = lambda calls: seconds_per_call(lambda: [c() for c in calls], device, 2) / len(calls)  # noqa: E731
    rows = []
    for name in GGUF_TYPES[3:4] if dry_run else GGUF_TYPES:
        for layer, features, in_features in DRY_RUN_GGUF_SHAPES if dry_run else GEMM_SHAPES:
            weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
            block_bytes = features * in_features // weights * size
            dense_bytes = features * in_features * dtype.itemsize
            blocks = [
                random_gguf_blocks(name, features, in_features, device)
                for _ in range(copies(block_bytes, dry_run))
            ]
            dense = [
                torch.randn(features, in_features, device=device, dtype=dtype)
                for _ in range(copies(dense_bytes, dry_run))
            ]
            for count in DRY_RUN_GGUF_ROWS if dry_run else GGUF_ROWS:
                x = torch.randn(count, in_features, device=device, dtype=dtype)
                out = torch.empty(count, features, device=device, dtype=dtype)
                base = timed([partial(F.linear, x, w) for w in dense])
                ours = timed([partial(gemv, out, x, b, name) for b in blocks])
                rows.append(
                    f"| {name} | {layer} {features}x{in_features} | {count} | {base * 1e6:.1f} | "
                    f"{ours * 1e6:.1f} | {base / ours:.2f} | "
                    f"{block_bytes / ours / 1e9:.0f} | {dense_bytes / base / 1e9:.0f} |"
                )
            del blocks, dense
    return (
        f"GGUF GEMV timing: {str(dtype).removeprefix('torch.')} activations, random blocks; "
        "on a GPU one CUDA graph per cell cycles through copies of the weight (> 128 MB, "
        "so HBM, not L2), CUDA events over its replays. Baseline: `F.linear` (cuBLAS) on "
        "dense matrices of the same shape (the file dequantized at load). Speed-up > 1: "
        "the blocks are faster. GB/s: weight bytes read per second.\n\n"
        "| type | layer | rows | dense µs | GGUF µs | speed-up | GGUF GB/s | dense GB/s |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def turbo_gguf_decode_speed(device: str) -> tuple[bool, str]:
    """SmolLM2-135M Q4_1 decode steps replayed as turbo's CUDA graphs: the file's blocks
    (quantization=gguf) beside the file dequantized to bfloat16 (none); logits compared."""
    from llmctl.errors import ModelError
    from llmctl.model.info import default_model_file

    try:
        path = default_model_file()
    except ModelError as exc:
        return False, f"Decode tokens/s: not run: {exc}\n"
    results = decode_speeds(path, ("none", "gguf"), GGUF_DECODE_BATCHES)
    rows, passed = [], True
    for num_seqs in GGUF_DECODE_BATCHES:
        (want, dense, dense_bytes), (got, blocks, block_bytes) = (
            results["none", num_seqs],
            results["gguf", num_seqs],
        )
        error = ((got - want).abs().max() / want.abs().max()).item()
        passed &= error < 0.1  # the same file; bf16 rounding of the dequantized weights
        rows.append(
            f"| {num_seqs} | {num_seqs / dense:.0f} | {num_seqs / blocks:.0f} | "
            f"{dense / blocks:.2f} | {error:.1e} | {dense_bytes / 2**20:.0f} | "
            f"{block_bytes / 2**20:.0f} |"
        )
    return passed, (
        f"Decode: `{path.name}`, bf16 activations, context {TURBO_DECODE_CONTEXT}, CUDA "
        "graphs (the runner's), CUDA events over 30 back-to-back steps. Logits error: max "
        "abs diff / max abs of the blocks' logits vs the dequantized file's (checked < "
        "0.1).\n\n| batch | dequantized bf16 tok/s | GGUF blocks tok/s | speed-up | logits "
        "error | bf16 weights MiB | GGUF weights MiB |\n|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )


PARTS = (run_tests, time_gemm, time_attention, quality, turbo_int8, turbo_gguf)

if __name__ == "__main__":
    import argparse
    import os

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", action="append", choices=[p.__name__ for p in PARTS],
        help="run only this part (repeatable); default: all",
    )  # fmt: skip
    args = parser.parse_args()
    chosen = [p for p in PARTS if p.__name__ in args.part] if args.part else None
    on_gpu = torch.cuda.is_available()
    child = dict(os.environ, PYTHONPATH=str(REPO), LLMCTL_TORCH_ATTENTION="triton")
    ok, report = quant_section("cuda" if on_gpu else "cpu", not on_gpu, child, chosen)
    print(report)
    sys.exit(0 if ok else 1)
