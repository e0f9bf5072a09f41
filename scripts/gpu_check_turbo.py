"""The turbo section of ``scripts/gpu_check.py``: turbo's CUDA kernels on the GPU machine.

``turbo_section(device, dry_run)`` returns ``(passed, markdown)``:

1. build: turbo's native ops with the CUDA kernels (nvcc, the current GPU's arch);
2. kernels: every CUDA op against turbo's CPU op on the same random inputs (fp32 and
   bf16, block sizes 16 / 48 / 64 / 256, GQA, shuffled blocks, ragged prefill chunks);
3. end to end: stories260K's greedy tokens through the turbo engine on the device,
   against transformers' (``reference_greedy.json``);
4. timing: paged decode attention, turbo's CUDA kernel beside the torch backend's
   Triton kernel, timed with CUDA events.

With ``dry_run`` on a machine without a GPU, the "device" is the CPU: the script's
plumbing runs on tiny shapes and the numbers mean nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
BLOCK_SIZES = (16, 48, 64, 256)
# (batch, context) points of the timing table; bf16, head_dim 128, 32 query / 8 KV heads.
TIMING_POINTS = ((1, 1024), (16, 2048), (64, 4096))
DRY_RUN_TIMING_POINTS = ((1, 64), (2, 128))


def turbo_section(device: str, dry_run: bool = False) -> tuple[bool, str]:
    lines = ["## Turbo: native CUDA kernels\n"]
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
    for part in (check_kernels, end_to_end, time_decode):
        ok, text = part(device, dry_run)
        passed &= ok
        lines.append(text)
    return passed, "\n".join(lines)


# ---------------------------------------------------------------------------- kernels


def random_paged_case(block_size: int, dtype, seed: int, small: bool):
    """CPU tensors for one attention call: shuffled blocks, ragged prefill + decode."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = (4, 2, 32) if small else (32, 8, 128)
    query_lens = [3, 1, block_size + 2, 1]
    context_lens = [3, 2 * block_size + 5, block_size + 9, 4 * block_size]
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, width = [], max(blocks_per_seq)
    for count in blocks_per_seq:
        tables.append(order[:count] + [0] * (width - count))
        order = order[count:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(
        q=torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def op_cases(dtype, small: bool):
    """(name, function of a dict of tensors → output tensor, inputs) for every op."""
    import torch
    from llmctl_turbo import ops
    from llmctl_turbo.rope import cos_sin_cache

    from llmctl.engine.rope import rope_inv_freq

    gen = torch.Generator().manual_seed(0)
    hidden, tokens = (64, 7) if small else (4096, 64)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    def rotary(t):
        q, k = t["q"].clone(), t["k"].clone()
        ops.rotary_embedding(t["positions"], q, k, t["cos_sin"])
        return torch.cat([q.flatten(), k.flatten()])

    def add_norm(t):
        residual = t["residual"].clone()
        out = ops.add_rms_norm(t["x"], residual, t["w"], 1e-5)
        return torch.cat([out.flatten(), residual.flatten()])

    def write(t):
        k_cache, v_cache = t["k_cache"].clone(), t["v_cache"].clone()
        ops.write_kv_cache(t["key"], t["value"], k_cache, v_cache, t["slots"])
        return torch.cat([k_cache.flatten(), v_cache.flatten()])

    cases = [
        (
            "rms_norm",
            lambda t: ops.rms_norm(t["x"], t["w"], 1e-5),
            dict(x=randn(tokens, hidden), w=randn(hidden)),
        ),
        (
            "add_rms_norm",
            add_norm,
            dict(x=randn(tokens, hidden), residual=randn(tokens, hidden), w=randn(hidden)),
        ),
        ("silu_and_mul", lambda t: ops.silu_and_mul(t["x"]), dict(x=randn(tokens, 2 * hidden))),
        (
            "rotary_embedding",
            rotary,
            dict(
                q=randn(tokens, 8, 64),
                k=randn(tokens, 2, 64),
                positions=torch.randint(0, 4096, (tokens,), generator=gen, dtype=torch.int32),
                cos_sin=cos_sin_cache(rope_inv_freq(64, 10000.0, None), 4096),
            ),
        ),
        (
            "write_kv_cache",
            write,
            dict(
                key=randn(tokens, 2, 64),
                value=randn(tokens, 2, 64),
                k_cache=randn(8, 16, 2, 64),
                v_cache=randn(8, 16, 2, 64),
                slots=torch.randperm(128, generator=gen)[:tokens].to(torch.int32),
            ),
        ),
    ]
    for block_size in BLOCK_SIZES:
        case = random_paged_case(block_size, dtype, seed=block_size, small=small)
        cases.append(
            (
                f"paged_prefill_attention bs={block_size}",
                lambda t: ops.paged_prefill_attention(
                    t["q"],
                    t["k_cache"],
                    t["v_cache"],
                    t["block_tables"],
                    t["query_start_loc"],
                    t["context_lens"],
                    t["scale"],
                ),
                case,
            )
        )
    return cases


def check_kernels(device: str, dry_run: bool) -> tuple[bool, str]:
    import torch

    rows, passed = [], True
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        for name, run, inputs in op_cases(dtype, small=dry_run):
            on_device = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
            }
            expected = run(inputs).float()
            got = run(on_device).float().cpu()
            error = (got - expected).abs().max().item()
            ok = error <= TOLERANCE[dtype_name] and bool(torch.isfinite(got).all())
            passed &= ok
            rows.append(f"| {name} | {dtype_name} | {error:.2e} | {'ok' if ok else 'FAIL'} |")
    return passed, (
        "### Kernels: CUDA against turbo's CPU kernels\n\n"
        f"**{'all match' if passed else 'MISMATCH'}** (max abs error; tolerance "
        f"{TOLERANCE['float32']:g} fp32, {TOLERANCE['bfloat16']:g} bf16).\n\n"
        "| op | dtype | max abs error | |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


# ---------------------------------------------------------------------------- end to end


def end_to_end(device: str, dry_run: bool) -> tuple[bool, str]:
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
    same = [list(o.token_ids) == list(want) for o, (_, want) in zip(outputs, cases)]
    passed = all(same)
    return passed, (
        title + f"float32, block size 32, {device}, {len(cases)} prompts, "
        f"{time.monotonic() - started:.1f} s: **{'all tokens match' if passed else 'MISMATCH'}** "
        f"({sum(same)}/{len(same)} identical).\n"
    )


# ---------------------------------------------------------------------------- timing


def seconds_per_call(fn, device: str, iterations: int) -> float:
    import torch

    fn()
    if device != "cuda":
        started = time.perf_counter()
        for _ in range(iterations):
            fn()
        return (time.perf_counter() - started) / iterations
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iterations


def time_decode(device: str, dry_run: bool) -> tuple[bool, str]:
    import torch
    from llmctl_turbo.ops import paged_decode_attention as turbo_decode

    try:
        from llmctl_torch.triton_decode import paged_decode_attention as triton_decode
    except ImportError:
        triton_decode = None
    heads, kv_heads, head_dim = (4, 2, 32) if dry_run else (32, 8, 128)
    block_size, dtype = 64, torch.bfloat16
    rows = []
    for batch, context in DRY_RUN_TIMING_POINTS if dry_run else TIMING_POINTS:
        per_seq = context // block_size
        shape = (batch * per_seq, block_size, kv_heads, head_dim)
        k_cache = torch.randn(shape, dtype=dtype, device=device)
        v_cache = torch.randn(shape, dtype=dtype, device=device)
        tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
        args = (q, k_cache, v_cache, tables, lens, head_dim**-0.5)
        iterations = 2 if dry_run else 50
        turbo = seconds_per_call(lambda a=args: turbo_decode(*a), device, iterations)
        cells = [f"{turbo * 1e6:.1f}"]
        if triton_decode is not None and not dry_run:
            triton = seconds_per_call(lambda a=args: triton_decode(*a), device, iterations)
            cells += [f"{triton * 1e6:.1f}", f"{triton / turbo:.2f}"]
        else:
            cells += ["not run", ""]
        kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
        cells.append(f"{kv_bytes / turbo / 1e9:.1f}")
        rows.append(f"| {batch} | {context} | " + " | ".join(cells) + " |")
    return True, (
        "### Timing: paged decode attention, turbo CUDA beside Triton\n\n"
        f"bf16, head_dim {head_dim}, {heads} query / {kv_heads} KV heads, block size "
        f"{block_size}, CUDA events over plain launches. Speed-up > 1: turbo is faster.\n\n"
        "| batch | context | turbo µs | Triton µs | speed-up | turbo K/V GB/s |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    import sys

    import torch

    on_gpu = torch.cuda.is_available()
    ok, report = turbo_section("cuda" if on_gpu else "cpu", dry_run=not on_gpu)
    print(report)
    sys.exit(0 if ok else 1)
