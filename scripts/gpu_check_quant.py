"""The quantization section of ``scripts/gpu_check.py``: int8 weights, int8 / fp8 KV cache.

``quant_section(device, dry_run, env)`` returns ``(passed, markdown)``:

1. kernel tests: the int8 GEMM, and the model with an int8 cache through the Triton
   kernels (the quantized-cache kernel tests, fp8 included on compute capability >= 8.9,
   are in ``test_triton_kernels.py``, which part 1 of ``gpu_check.py`` runs);
2. int8 GEMM timing: the Triton kernel beside bf16 ``F.linear`` (cuBLAS) on the
   layer shapes of the 723.6M reference Llama, for decode (1, 16 rows) and prefill (256);
3. decode attention timing over a bf16, an int8 and an fp8 cache;
4. end to end: ``llmctl bench quality`` on stories260K on the device, each variant
   against float32 (teacher-forced agreement and perplexity are checked, as in
   tests/backends/torch/test_quant_e2e.py; fp8 is reported, not checked).

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

from gpu_check_turbo import seconds_per_call  # scripts/ is on sys.path when run as a script

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


def quant_section(device: str, dry_run: bool, env: dict[str, str]) -> tuple[bool, str]:
    lines = ["## Quantization: int8 weights, int8 / fp8 KV cache\n"]
    passed = True
    for part in (run_tests, time_gemm, time_attention, quality):
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
    from llmctl_torch.triton_decode import paged_decode_attention

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
    passed = dry_run or all(
        minimum is None
        or (
            run["teacher_forced_agreement"] >= minimum
            and abs(run["ratios"]["perplexity"] - 1) <= 0.02
        )
        for run, minimum in zip(report["runs"], TEACHER_FORCED_MIN)
    )
    return passed, (
        title + f"float32 on {device}, {time.monotonic() - started:.0f} s; checked: "
        "teacher-forced agreement >= 95 % / 95 % / 90 % and perplexity within 2 % "
        f"(fp8 reported only): **{'met' if passed else 'NOT MET'}**.\n\n"
        + markdown(quality_table(report))
        + "\n"
    )


if __name__ == "__main__":
    import os

    import torch

    on_gpu = torch.cuda.is_available()
    child = dict(os.environ, PYTHONPATH=str(REPO), LLMCTL_TORCH_ATTENTION="triton")
    ok, report = quant_section("cuda" if on_gpu else "cpu", not on_gpu, child)
    print(report)
    sys.exit(0 if ok else 1)
