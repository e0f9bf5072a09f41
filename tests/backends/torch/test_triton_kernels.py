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
    write_kv,
)
from llmctl_torch.triton_decode import plan_splits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual = actual.cpu()
    assert not actual.isnan().any(), "the kernel left output elements unwritten (NaN)"
    torch.testing.assert_close(actual.double(), expected, **TOLERANCE[dtype])


def check_decode(block_size, num_kv_heads, group, head_dim, dtype, context_lens, num_splits=None):
    generator = torch.Generator().manual_seed(len(context_lens) * 1000 + block_size + head_dim)
    ctx = make_paged_contexts(context_lens, num_kv_heads, head_dim, block_size, dtype, generator)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q.to(DEVICE), ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.context_lens, scale,
        num_splits=num_splits,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.cat(
        [
            reference_attention(q[b : b + 1], k, v, scale)
            for b, (k, v) in enumerate(zip(ctx.keys, ctx.values))
        ]
    )
    assert_close(out, expected, dtype)


def check_prefill(block_size, num_kv_heads, group, head_dim, dtype, seqs):
    """``seqs``: ``(query_len, context_len)`` per sequence."""
    generator = torch.Generator().manual_seed(len(seqs) * 1000 + block_size + head_dim)
    query_lens = [q_len for q_len, _ in seqs]
    ctx = make_paged_contexts(
        [n for _, n in seqs], num_kv_heads, head_dim, block_size, dtype, generator
    )
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator)
    q = q.to(dtype)
    starts = [0, *itertools.accumulate(query_lens)]
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q.to(DEVICE),
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables,
        query_start_loc,
        ctx.context_lens,
        scale,
    )
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.cat(
        [
            reference_attention(q[starts[b] : starts[b + 1]], k, v, scale)
            for b, (k, v) in enumerate(zip(ctx.keys, ctx.values))
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
    ships ptxas). Runs in a child process started with ``TRITON_INTERPRET=0``."""
    from llmctl_torch import triton_attention, triton_decode, triton_prefill
    from llmctl_torch.triton_common import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_kernel(kernel, constants, arch, dtype, num_warps=4, num_stages=2):
        fn = kernel.fn if hasattr(kernel, "configs") else kernel  # unwrap the autotuner
        # Argument types as the launcher infers them from the tensors the wrappers pass.
        types = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "qk_scale": "fp32"}
        types |= {"query_start_loc_ptr": "*i32", "slot_mapping_ptr": "*i64"}
        types |= {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
        signature = {}
        for p in fn.params:
            if p.is_constexpr:
                signature[p.name] = "constexpr"
            else:
                default = f"*{dtype}" if p.name.endswith("_ptr") else "i32"
                signature[p.name] = types.get(p.name, default)
        source = ASTSource(fn, signature, constexprs=constants)
        options = dict(num_warps=num_warps, num_stages=num_stages)
        triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)

    shape = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=64)
    # Every tuning config on Hopper in bf16; one config on Ampere in fp16 and fp32.
    for arch, dtype, configs in [(90, "bf16", None), (80, "fp16", 1), (80, "fp32", 1)]:
        for config in triton_decode._decode_kernel.configs[:configs]:
            for split in (False, True):
                constants = shape | config.kwargs | dict(SPLIT=split, UPCAST=False)
                compile_kernel(triton_decode._decode_kernel, constants, arch, dtype,
                               config.num_warps, config.num_stages)  # fmt: skip
        for config in triton_prefill._prefill_kernel.configs[:configs]:
            constants = shape | config.kwargs | dict(GROUP_PAD=4, UPCAST=False)
            compile_kernel(triton_prefill._prefill_kernel, constants, arch, dtype,
                           config.num_warps, config.num_stages)  # fmt: skip
        compile_kernel(
            triton_decode._combine_splits_kernel,
            dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=4),
            arch,
            dtype,
        )
        compile_kernel(
            triton_attention._write_kv_kernel,
            dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=64)
            | dict(UPCAST=False),
            arch,
            dtype,
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
