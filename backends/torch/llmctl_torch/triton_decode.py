"""Paged decode attention in Triton: one new query token per sequence against its KV blocks.

Decode is bound by memory bandwidth: every step reads each sequence's whole K/V once.
So the kernel is shaped around reading the cache well:

- one program per (sequence, KV head, split): the query heads that share a KV head
  (a GQA group) are processed together, so each K/V element is read once per step;
- split-K: a long context is cut into splits handled by separate programs, so a small
  batch still spreads over every SM. Each split keeps its own online softmax and writes a
  partial output plus its log-sum-exp; a second, tiny kernel combines the splits;
- each loop step loads a tile of ``TILE_N`` tokens as whole ``head_dim`` rows, looked
  up token by token in the block table, so any block size works with any tile size.
"""

from __future__ import annotations

import functools

import torch

from llmctl_torch.triton_common import (
    LOG2_E,
    UPCAST_LOADS,
    KVScales,
    attend_kv_tile,
    check_paged_cache,
    check_query,
    dot_tile,
    index_tensor,
    scale_args,
    tl,
    triton,
    tuning_configs,
)

# A split covers a power of two of at least this many tokens: every tile size divides
# it, and the autotuner (keyed on it) meets only a few distinct values.
SPLIT_GRANULE = 128
# The default never cuts splits shorter than this: below it, writing and combining the
# partial results costs more than the extra parallelism gains.
MIN_DEFAULT_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Aim for this many programs per SM so memory latency is hidden by other programs.
PROGRAMS_PER_SM = 4


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(
    programs: int, max_context: int, device: torch.device, num_splits: int | None = None
) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)`` for ``programs`` (sequence, KV head) pairs.

    By default: enough splits to fill the GPU, but none shorter than
    ``MIN_DEFAULT_SPLIT_TOKENS``. It depends only on shapes (not on the lengths stored
    on the GPU), so it never waits for the device and a captured CUDA graph stays valid.
    """
    if num_splits is None:
        wanted = triton.cdiv(PROGRAMS_PER_SM * _multiprocessor_count(device), programs)
        by_length = triton.cdiv(max_context, MIN_DEFAULT_SPLIT_TOKENS)
        num_splits = max(1, min(wanted, by_length, MAX_SPLITS))
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    per_split = triton.next_power_of_2(triton.cdiv(max_context, num_splits))
    tokens_per_split = max(SPLIT_GRANULE, per_split)
    return triton.cdiv(max_context, tokens_per_split), tokens_per_split


@triton.autotune(
    configs=tuning_configs(
        gpu=[
            ({"TILE_N": 32}, 4, 3),
            ({"TILE_N": 64}, 4, 3),
            ({"TILE_N": 64}, 8, 2),
            ({"TILE_N": 128}, 8, 2),
        ],
        interpreted={"TILE_N": 64},
    ),
    # The best tile depends on how many tokens a program walks (tokens_per_split); a new
    # value costs a re-benchmark of the already compiled configs (well under a second).
    key=["GROUP_PAD", "HEAD_DIM_PAD", "BLOCK_SIZE", "SPLIT", "tokens_per_split"],
)
@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    qk_scale,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_scale_block,
    stride_scale_token,
    stride_scale_head,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANTIZED: tl.constexpr,
    TILE_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    head_mask = group < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    qo_mask = head_mask[:, None] & dim_mask[None, :]

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=qo_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    block_table = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_cache_head + dims[None, :]
    scale_head_offset = kv_head * stride_scale_head
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < end
        m, l, acc = attend_kv_tile(  # noqa: E741
            q,
            m,
            l,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            block_table,
            head_offset,
            scale_head_offset,
            dim_mask,
            pos,
            valid,
            valid[None, :],
            qk_scale,
            stride_cache_block,
            stride_cache_token,
            stride_scale_block,
            stride_scale_token,
            BLOCK_SIZE,
            UPCAST,
            QUANTIZED,
        )

    # A split past the end of a short sequence saw no token: l == 0, output 0, lse -inf.
    has_tokens = l > 0.0
    l_safe = tl.where(has_tokens, l, 1.0)
    result = acc / l_safe[:, None]
    if SPLIT:
        partial_rows = (seq * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
        lse = tl.where(has_tokens, m + tl.log2(l_safe), float("-inf"))
        tl.store(partial_lse_ptr + partial_rows, lse, mask=head_mask)
        tl.store(
            partial_out_ptr + partial_rows[:, None] * HEAD_DIM + dims[None, :],
            result,
            mask=qo_mask,
        )
    else:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=qo_mask,
        )


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """out = sum_s 2^lse_s * partial_s / sum_s 2^lse_s, for one (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    rows = (seq * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(partial_lse_ptr + rows, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    partial = tl.load(
        partial_out_ptr + rows[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    result = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    kv_scales: KVScales = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    ``q: [batch, num_heads, head_dim]``; ``k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]`` (int8 / fp8 with ``kv_scales``, see ``attention.py``);
    ``block_tables: [batch, max_blocks]``; ``context_lens: [batch]`` (at least 1: the
    cache already holds this step's token). Returns ``[batch, num_heads, head_dim]``.
    ``num_splits`` overrides the split-K heuristic.
    """
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache, kv_scales)
    group = check_query(q, k_cache, num_kv_heads, head_dim)
    block_tables = index_tensor("block_tables", block_tables, 2, q.device)
    context_lens = index_tensor("context_lens", context_lens, 1, q.device)
    batch, num_heads, _ = q.shape
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables ({block_tables.shape[0]} rows) and context_lens "
            f"({context_lens.shape[0]}) must have one entry per query ({batch})"
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0 or block_tables.shape[1] == 0:
        return out.zero_()

    # The block table's width bounds every context length without reading them back.
    max_context = block_tables.shape[1] * block_size
    num_splits, tokens_per_split = plan_splits(
        batch * num_kv_heads, max_context, q.device, num_splits
    )

    split = num_splits > 1
    if split:
        partial_out = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            (batch, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:  # unused by the kernel: the single split writes straight into out
        partial_out = partial_lse = out

    k_scale, v_scale, *scale_strides = scale_args(k_cache, kv_scales)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        out,
        partial_out,
        partial_lse,
        scale * LOG2_E,
        tokens_per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=dot_tile(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dot_tile(head_dim),
        BLOCK_SIZE=block_size,
        SPLIT=split,
        UPCAST=UPCAST_LOADS,
        QUANTIZED=kv_scales is not None,
    )
    if split:
        _combine_splits_kernel[(batch, num_heads)](
            partial_out,
            partial_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
