"""The Triton paged-attention kernels against a dense float64 reference on random inputs.

On a GPU the kernels run compiled (``scripts/gpu_check.py`` runs this file there);
without CUDA they run through the Triton interpreter (slow: about 50 ms per program), so
the default grid is small and a wider one is marked slow. Inputs are drawn on the CPU,
the reference is computed there in float64. Every case:

- scatters each sequence's K/V into shuffled, non-contiguous cache blocks; the unused
  slots of the cache are NaN and block-table padding points at a NaN block, so a kernel
  reading a token it should mask turns the output NaN;
- fills every tensor the kernels allocate with NaN (``poisoned_allocations``), so an
  output element (or split-K partial) the kernels forget to write fails the comparison.

An int8 / fp8 cache case quantizes the same cache per token and head (its unused slots
get NaN scales) and compares against the reference run on the dequantized K/V: the
kernels must dequantize exactly as ``llmctl.engine.quant`` does, so the float
tolerances hold unchanged. fp8 needs a GPU (compute capability >= 8.9): those tests
are marked ``gpu`` and skip here.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from llmctl_torch.triton_attention import (
    paged_decode_attention,
    paged_prefill_attention,
    plan_splits,
    write_kv,
)

from llmctl.engine.quant import dequantize_kv, quantize_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I8, FP8 = torch.int8, torch.float8_e4m3fn
HAS_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_FP8, reason="fp8 needs a CUDA GPU of compute capability >= 8.9"),
]
TOLERANCE = {
    F32: dict(atol=1e-4, rtol=1e-4),
    F16: dict(atol=1e-2, rtol=1e-2),
    BF16: dict(atol=3e-2, rtol=3e-2),
}


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating tensor made with torch.empty during the test starts as NaN."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", nan_empty)


@dataclass
class PagedContexts:
    """Random per-sequence K/V, and the same K/V scattered into a paged cache."""

    keys: list[torch.Tensor]  # per sequence, [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32, padded with a NaN-filled block
    context_lens: torch.Tensor  # int32


def make_paged_contexts(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> PagedContexts:
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 2  # spares stay NaN; one pads the block tables
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    padding_block = free.pop()
    keys, values, tables = [], [], []
    for n, count in zip(context_lens, blocks_needed):
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        table = [free.pop() for _ in range(count)]
        for pos in range(n):  # plain indexing, independent of write_kv
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
        tables.append(table)
    width = max(blocks_needed) + 1  # at least one padding entry per row
    block_tables = torch.tensor(
        [t + [padding_block] * (width - len(t)) for t in tables], dtype=torch.int32
    )
    context_lens_t = torch.tensor(context_lens, dtype=torch.int32)
    return PagedContexts(
        keys,
        values,
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        block_tables.to(DEVICE),
        context_lens_t.to(DEVICE),
    )


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention in float64 of ``q: [Q, Hq, D]``, the last Q of ``keys: [L, Hkv, D]``;
    query head h reads KV head h // group."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(ctx_len - q_len, ctx_len)
    scores.masked_fill_(torch.arange(ctx_len)[None, :] > query_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def quantized_inputs(ctx: PagedContexts, kv_dtype: torch.dtype | None, dtype: torch.dtype):
    """``(k_cache, v_cache, kv_scales, keys, values)`` for the kernels and the reference:
    the float cache as is, or quantized to ``kv_dtype`` with its K/V dequantized to
    ``dtype`` (each token's row is quantized on its own, so quantizing the sequences'
    K/V gives what the cache holds)."""
    if kv_dtype is None:
        return ctx.k_cache, ctx.v_cache, None, ctx.keys, ctx.values
    k_cache, k_scale = quantize_kv(ctx.k_cache, kv_dtype)  # unused slots: NaN scales
    v_cache, v_scale = quantize_kv(ctx.v_cache, kv_dtype)

    def round_trip(x):
        return dequantize_kv(*quantize_kv(x, kv_dtype), dtype)

    keys = [round_trip(k) for k in ctx.keys]
    values = [round_trip(v) for v in ctx.values]
    return k_cache, v_cache, (k_scale, v_scale), keys, values


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual = actual.cpu()
    assert not actual.isnan().any(), "the kernel left output elements unwritten (NaN)"
    torch.testing.assert_close(actual.double(), expected, **TOLERANCE[dtype])


def check_decode(
    block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits=None, kv_dtype=None
):
    generator = torch.Generator().manual_seed(len(context_lens) * 1000 + block_size + head_dim)
    ctx = make_paged_contexts(context_lens, num_kv_heads, head_dim, block_size, dtype, generator)
    k_cache, v_cache, kv_scales, keys, values = quantized_inputs(ctx, kv_dtype, dtype)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q.to(DEVICE), k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
        kv_scales=kv_scales, num_splits=num_splits,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.cat(
        [
            reference_attention(q[b : b + 1], k, v, scale)
            for b, (k, v) in enumerate(zip(keys, values))
        ]
    )
    assert_close(out, expected, dtype)


def check_prefill(block_size, num_kv_heads, group, head_dim, dtype, seqs, kv_dtype=None):
    """``seqs``: ``(query_len, context_len)`` per sequence."""
    generator = torch.Generator().manual_seed(len(seqs) * 1000 + block_size + head_dim)
    query_lens = [q_len for q_len, _ in seqs]
    ctx = make_paged_contexts(
        [n for _, n in seqs], num_kv_heads, head_dim, block_size, dtype, generator
    )
    k_cache, v_cache, kv_scales, keys, values = quantized_inputs(ctx, kv_dtype, dtype)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype)
    starts = [0, *itertools.accumulate(query_lens)]
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q.to(DEVICE),
        k_cache,
        v_cache,
        ctx.block_tables,
        query_start_loc,
        ctx.context_lens,
        scale,
        kv_scales=kv_scales,
    )
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.cat(
        [
            reference_attention(q[starts[b] : starts[b + 1]], k, v, scale)
            for b, (k, v) in enumerate(zip(keys, values))
        ]
    )
    assert_close(out, expected, dtype)


# (block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits)
DECODE_CASES = [
    # ragged lengths: 1, exactly one block, one past a boundary, several blocks
    (16, 2, 2, 24, F32, [1, 16, 17, 50], None),
    (32, 1, 8, 64, F32, [64, 5], None),  # MQA, group of 8, lengths on a boundary
    (64, 3, 1, 8, F32, [128, 1, 70], None),  # MHA with 3 KV heads, head_dim 8
    (128, 2, 4, 40, F32, [130, 128], None),
    (256, 1, 2, 16, F32, [256, 300], None),
    # split-K: a long context over 3 splits next to short ones whose later splits are empty
    (16, 2, 4, 32, F32, [600, 3, 129], 4),
    (32, 1, 2, 16, F32, [700], 64),  # more splits asked than fit: capped
    (32, 2, 2, 64, F16, [33, 96, 2], None),
    (64, 2, 4, 128, BF16, [65, 300], 2),
    (16, 1, 1, 256, BF16, [40], None),
]


@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,dtype,context_lens,num_splits", DECODE_CASES
)
def test_decode_matches_reference(
    block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits
):
    check_decode(block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits)


# (block_size, num_kv_heads, group, head_dim, dtype, [(query_len, context_len), ...])
PREFILL_CASES = [
    # whole prompts: one token, exactly a block, ragged, and a chunk after a cached prefix
    (16, 2, 2, 24, F32, [(1, 1), (16, 16), (23, 23), (5, 37)]),
    (32, 1, 8, 64, F32, [(40, 40), (1, 70)]),  # MQA: 16 query tokens per tile, 3 tiles
    (64, 4, 1, 8, F32, [(130, 130), (7, 64)]),  # MHA: 128 query tokens per tile
    (128, 2, 4, 40, F32, [(20, 150)]),
    (256, 1, 2, 16, F32, [(3, 256), (33, 33)]),
    (16, 2, 2, 32, F16, [(17, 17), (4, 40)]),
    (64, 2, 4, 128, BF16, [(24, 90), (1, 1)]),
    (16, 1, 1, 256, BF16, [(9, 20)]),
]


@pytest.mark.parametrize("block_size,num_kv_heads,group,head_dim,dtype,seqs", PREFILL_CASES)
def test_prefill_matches_reference(block_size, num_kv_heads, group, head_dim, dtype, seqs):
    check_prefill(block_size, num_kv_heads, group, head_dim, dtype, seqs)


# (block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits): a few
# of the float cases again over a quantized cache (the interpreter is slow).
QUANTIZED_DECODE_CASES = [
    (16, 2, 2, 24, F32, [1, 16, 17, 50], None),
    (16, 2, 4, 32, F32, [600, 3, 129], 4),
    (64, 2, 4, 128, BF16, [65, 300], 2),
]
QUANTIZED_PREFILL_CASES = [
    (16, 2, 2, 24, F32, [(1, 1), (16, 16), (23, 23), (5, 37)]),
    (64, 2, 4, 128, BF16, [(24, 90), (1, 1)]),
]


@pytest.mark.parametrize("kv_dtype", [I8, pytest.param(FP8, marks=needs_fp8)], ids=["int8", "fp8"])
@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,dtype,context_lens,num_splits",
    QUANTIZED_DECODE_CASES,
)
def test_decode_over_a_quantized_cache(
    block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits, kv_dtype
):
    check_decode(
        block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits, kv_dtype
    )


@pytest.mark.parametrize("kv_dtype", [I8, pytest.param(FP8, marks=needs_fp8)], ids=["int8", "fp8"])
@pytest.mark.parametrize(
    "block_size,num_kv_heads,group,head_dim,dtype,seqs", QUANTIZED_PREFILL_CASES
)
def test_prefill_over_a_quantized_cache(
    block_size, num_kv_heads, group, head_dim, dtype, seqs, kv_dtype
):
    check_prefill(block_size, num_kv_heads, group, head_dim, dtype, seqs, kv_dtype)


@pytest.mark.parametrize("kv_dtype", [I8, pytest.param(FP8, marks=needs_fp8)], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype,num_kv_heads,head_dim", [(F32, 3, 24), (BF16, 2, 64)])
def test_write_kv_quantizes_each_token_like_the_reference(kv_dtype, dtype, num_kv_heads, head_dim):
    """The scales match ``quantize_kv``'s; the codes may differ where x / scale lands on a
    rounding boundary (the kernel divides with the GPU's fast division and rounds ties
    away from zero, torch to even), so every dequantized element must be what the
    reference's is up to one step of its row, and a valid quantization of the input."""
    generator = torch.Generator().manual_seed(head_dim + 1)
    num_blocks, block_size = 4, 16
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, device=DEVICE).to(kv_dtype)
    v_cache = torch.zeros(shape, device=DEVICE).to(kv_dtype)
    scales = torch.full((2, *shape[:3]), float("nan"), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:19]
    slots[5] = -1  # a padding token: leaves its slot alone
    k = (torch.randn(19, num_kv_heads, head_dim, generator=generator) * 3).to(dtype)
    v = torch.randn(19, num_kv_heads, head_dim, generator=generator).to(dtype)

    write_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE),
             kv_scales=(scales[0], scales[1]))  # fmt: skip

    written = slots >= 0
    for x, cache, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        x = x[written].float()
        got_scale = scale.cpu().view(-1, num_kv_heads)[slots[written]]
        got = dequantize_kv(cache.cpu().view(-1, num_kv_heads, head_dim)[slots[written]],
                            got_scale, F32)  # fmt: skip
        want_codes, want_scale = quantize_kv(x, kv_dtype)
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
        step = want_scale[..., None]
        if kv_dtype == I8:
            assert ((got - dequantize_kv(want_codes, want_scale, F32)).abs() <= step * 1.001).all()
            assert ((got - x).abs() <= step * 0.501).all()
        else:  # e4m3: 3 mantissa bits
            assert ((got - x).abs() <= torch.maximum(x.abs() * 2**-4, step * 2**-9)).all()
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slots[written]] = False
        assert scale.cpu().view(-1, num_kv_heads)[untouched].isnan().all()


def test_a_quantized_cache_without_its_scales_is_refused():
    k_cache = torch.zeros(2, 16, 1, 8, dtype=I8, device=DEVICE)
    q = torch.zeros(1, 1, 8, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="needs its scales"):
        paged_decode_attention(q, k_cache, k_cache.clone(), tables, lens, 1.0)
    wrong = torch.zeros(2, 16, 1, dtype=F16, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        paged_decode_attention(q, k_cache, k_cache.clone(), tables, lens, 1.0,
                               kv_scales=(wrong, wrong))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_kernels_over_a_wider_grid(block_size, group):
    # dtype and head_dim vary along the grid: every block size meets all of them
    case = 4 * [16, 32, 64, 128, 256].index(block_size) + [1, 2, 4, 8].index(group)
    dtype = [F32, F16, BF16][case % 3]
    head_dim = [24, 64, 8, 128][case % 4]
    lens = [1, block_size, block_size + 1, 2 * block_size + 7]
    check_decode(block_size, 2, group, head_dim, dtype, lens)
    check_decode(block_size, 2, group, head_dim, dtype, [3 * block_size + 5, 2], num_splits=3)
    check_prefill(
        block_size, 2, group, head_dim, dtype,
        [(1, 1), (block_size, block_size), (9, 2 * block_size + 3), (block_size + 3, block_size + 3)],
    )  # fmt: skip


@pytest.mark.parametrize("dtype,num_kv_heads,head_dim", [(F32, 3, 24), (BF16, 1, 8), (F16, 4, 128)])
def test_write_kv_stores_each_token_in_its_slot(dtype, num_kv_heads, head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size = 6, 16
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:21]
    slots[[3, 11]] = -1  # padding tokens: must leave the cache alone
    k = torch.randn(21, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(21, num_kv_heads, head_dim, generator=generator).to(dtype)

    write_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))

    written = slots >= 0
    flat_k = k_cache.cpu().view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.cpu().view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots[written]], k[written])
    assert torch.equal(flat_v[slots[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_write_kv_accepts_strided_inputs_from_a_fused_projection():
    """The model splits K and V out of one qkv projection: rows are not contiguous."""
    generator = torch.Generator().manual_seed(7)
    qkv = torch.randn(5, 3 * 2 * 8, generator=generator).to(DEVICE)
    _, k, v = qkv.split([16, 16, 16], dim=-1)
    k, v = k.view(5, 2, 8), v.view(5, 2, 8)
    k_cache = torch.zeros(2, 16, 2, 8, device=DEVICE)
    v_cache = torch.zeros(2, 16, 2, 8, device=DEVICE)
    slots = torch.tensor([17, 3, 0, 31, 16], device=DEVICE)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 8)[slots], k)
    assert torch.equal(v_cache.view(-1, 2, 8)[slots], v)


def test_splits_fill_the_gpu_without_tiny_splits():
    cpu = torch.device("cpu")  # one "SM": the programs alone decide
    assert plan_splits(programs=8, max_context=8192, device=cpu) == (1, 8192)
    assert plan_splits(programs=1, max_context=8192, device=cpu) == (4, 2048)
    assert plan_splits(programs=1, max_context=100, device=cpu) == (1, 128)
    # Asked for more splits than whole 128-token pieces: capped.
    assert plan_splits(programs=1, max_context=300, device=cpu, num_splits=8) == (3, 128)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(block_size=24), "power of two"),
        (dict(num_heads=6, num_kv_heads=4), "multiple of the KV head count"),
        (dict(q_dtype=F16), "dtype"),
        (dict(head_dim=300), "head_dim"),
    ],
)
def test_bad_inputs_are_refused_with_a_reason(change, message):
    p = dict(block_size=16, num_heads=4, num_kv_heads=2, head_dim=8, q_dtype=F32) | change
    k_cache = torch.zeros(3, p["block_size"], p["num_kv_heads"], p["head_dim"], device=DEVICE)
    q = torch.zeros(2, p["num_heads"], p["head_dim"], dtype=p["q_dtype"], device=DEVICE)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(q, k_cache, k_cache.clone(), tables, lens, 1.0)


def compile_for_nvidia_gpus() -> None:
    """Compile every kernel and tuning config for sm_80 and sm_90 (no GPU needed: Triton
    ships ptxas), the int8 / fp8 cache variants and the int8 GEMM too. Runs in a child
    process started with ``TRITON_INTERPRET=0``."""
    from llmctl_torch import triton_attention, triton_int8_linear
    from llmctl_torch.triton_common import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_kernel(kernel, constants, arch, dtype, num_warps=4, num_stages=2, types=None):
        fn = kernel.fn if hasattr(kernel, "configs") else kernel  # unwrap the autotuner
        # Argument types as the launcher infers them from the tensors the wrappers pass.
        known = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "qk_scale": "fp32"}
        known |= {"query_start_loc_ptr": "*i32", "slot_mapping_ptr": "*i64"}
        known |= {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
        known |= types or {}
        signature = {}
        for p in fn.params:
            if p.is_constexpr:
                signature[p.name] = "constexpr"
            else:
                default = f"*{dtype}" if p.name.endswith("_ptr") else "i32"
                signature[p.name] = known.get(p.name, default)
        source = ASTSource(fn, signature, constexprs=constants)
        options = dict(num_warps=num_warps, num_stages=num_stages)
        triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)

    def quantized_cache(cache: str) -> dict[str, str]:
        caches = {"k_cache_ptr": cache, "v_cache_ptr": cache}
        return caches | {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}

    shape = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=64)
    float_cache = (False, None)
    # Every tuning config on Hopper in bf16 (with an int8 and an fp8 cache too); one
    # config on Ampere in fp16 (with an int8 cache) and fp32.
    for arch, dtype, configs, caches in [
        (90, "bf16", None, [float_cache, (True, "*i8"), (True, "*fp8e4nv")]),
        (80, "fp16", 1, [float_cache, (True, "*i8")]),
        (80, "fp32", 1, [float_cache]),
    ]:
        for quantized, cache in caches:
            types = quantized_cache(cache) if quantized else None
            flags = dict(UPCAST=False, QUANTIZED=quantized)
            for config in triton_attention._decode_kernel.configs[:configs]:
                for split in (False, True):
                    constants = shape | config.kwargs | flags | dict(SPLIT=split)
                    compile_kernel(triton_attention._decode_kernel, constants, arch, dtype,
                                   config.num_warps, config.num_stages, types)  # fmt: skip
            for config in triton_attention._prefill_kernel.configs[:configs]:
                constants = shape | config.kwargs | flags | dict(GROUP_PAD=4)
                compile_kernel(triton_attention._prefill_kernel, constants, arch, dtype,
                               config.num_warps, config.num_stages, types)  # fmt: skip
            qmax, round_ = {None: (0.0, False), "*i8": (127.0, True), "*fp8e4nv": (448.0, False)}[
                cache
            ]
            compile_kernel(
                triton_attention._write_kv_kernel,
                dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=64)
                | dict(QMAX=qmax, ROUND=round_),
                arch,
                dtype,
                types=types,
            )
        compile_kernel(
            triton_attention._combine_splits_kernel,
            dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=4),
            arch,
            dtype,
        )
        for config in triton_int8_linear._int8_linear_kernel.configs[:configs]:
            compile_kernel(
                triton_int8_linear._int8_linear_kernel,
                config.kwargs | dict(ROW_BUCKET=16, UPCAST=False),
                arch,
                dtype,
                config.num_warps,
                config.num_stages,
                types={"w_ptr": "*i8", "scale_ptr": "*fp32"},
            )


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the other tests compile for real")
def test_kernels_compile_for_nvidia_gpus_without_one():
    """The interpreter accepts code the GPU compiler refuses (loop-carried type changes,
    dot shapes under 16, ...): compile for real so a CPU-only checkout catches it."""
    repo = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(repo))
    code = "import tests.backends.torch.test_triton_kernels as t; t.compile_for_nvidia_gpus()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
