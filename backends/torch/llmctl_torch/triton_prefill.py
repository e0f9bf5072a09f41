"""Paged prefill attention in Triton: a chunk of new tokens per sequence against its KV blocks.

The new tokens of sequence ``b`` are the last ``q_len`` of its ``context_len`` cached
tokens (their K/V were written first), so query ``i`` sits at position
``context_len - q_len + i`` and attends to cache positions ``0 ..`` that position: the
cached prefix from earlier steps plus causal attention within the chunk.

One program handles a tile of ``BLOCK_M`` rows for one (sequence, KV head): the rows
are ``BLOCK_M // GROUP_PAD`` query tokens times the query heads of the KV head's group,
so every K/V tile loaded serves the whole group. Programs are laid out over the
flattened tokens without reading sequence lengths back to the host: a program finds
its sequence by binary search over ``query_start_loc``.
"""

from __future__ import annotations

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

MAX_GROUP = 128  # the largest tile, in rows, a group of query heads must fit in


def _keep_tiles_that_fit_the_group(configs, named_args, **kwargs):
    return [c for c in configs if c.kwargs["BLOCK_M"] >= kwargs["GROUP_PAD"]]


@triton.autotune(
    configs=tuning_configs(
        gpu=[
            ({"BLOCK_M": 64, "TILE_N": 64}, 4, 2),
            ({"BLOCK_M": 128, "TILE_N": 32}, 4, 3),
            ({"BLOCK_M": 128, "TILE_N": 64}, 8, 2),
        ],
        interpreted={"BLOCK_M": 128, "TILE_N": 64},
    ),
    key=["GROUP_PAD", "HEAD_DIM_PAD", "BLOCK_SIZE"],
    prune_configs_by={"early_config_prune": _keep_tiles_that_fit_the_group},
)
@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_scale_block,
    stride_scale_token,
    stride_scale_head,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANTIZED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD  # query tokens per tile
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence b owns tiles first_tile(b) .. first_tile(b) + cdiv(q_len_b, BLOCK_Q) - 1,
    # where first_tile(b) = query_start_loc[b] // BLOCK_Q + b (increasing in b). Find the
    # last b with first_tile(b) <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_query = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_query >= q_len:  # a spare program: the grid is sized for the worst case
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len  # cached tokens before this chunk

    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // GROUP_PAD
    group = rows % GROUP_PAD
    row_mask = (query < q_len) & (group < GROUP)
    query_pos = prefix_len + query
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + group

    q_tokens = (q_start + query).to(tl.int64)
    q = tl.load(
        q_ptr + q_tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # Keys up to the tile's last query; the first key tile is never fully masked for a
    # row (key 0 precedes every query), so m is finite after it and exp2 never sees nan.
    kv_end = tl.minimum(prefix_len + first_query + BLOCK_Q, context_len)
    block_table = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_cache_head + dims[None, :]
    scale_head_offset = kv_head * stride_scale_head
    for tile_start in range(0, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < kv_end
        causal = valid[None, :] & (pos[None, :] <= query_pos[:, None])
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
            causal,
            qk_scale,
            stride_cache_block,
            stride_cache_token,
            stride_scale_block,
            stride_scale_token,
            BLOCK_SIZE,
            UPCAST,
            QUANTIZED,
        )

    result = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(
        out_ptr + q_tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    kv_scales: KVScales = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V.

    ``q: [tokens, num_heads, head_dim]`` holds sequence ``b``'s new tokens in rows
    ``query_start_loc[b] : query_start_loc[b + 1]``; they are the last tokens of its
    ``context_lens[b]`` cached ones. An int8 / fp8 cache comes with ``kv_scales``.
    Returns ``[tokens, num_heads, head_dim]``.
    """
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache, kv_scales)
    group = check_query(q, k_cache, num_kv_heads, head_dim)
    block_tables = index_tensor("block_tables", block_tables, 2, q.device)
    query_start_loc = index_tensor("query_start_loc", query_start_loc, 1, q.device)
    context_lens = index_tensor("context_lens", context_lens, 1, q.device)
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"for {num_seqs} sequences (context_lens), block_tables needs {num_seqs} rows "
            f"(has {block_tables.shape[0]}) and query_start_loc {num_seqs + 1} entries "
            f"(has {query_start_loc.shape[0]})"
        )
    if group > MAX_GROUP:
        raise ValueError(
            f"{group} query heads per KV head is more than the prefill kernel's "
            f"{MAX_GROUP}; use LLMCTL_TORCH_ATTENTION=torch for this model"
        )
    num_tokens = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Rows are (query token, head of the group) pairs: only the row count needs to be a
    # `tl.dot` tile, so the group pads to a power of two, not to 16 as in decode.
    group_pad = triton.next_power_of_2(group)

    def grid(meta: dict) -> tuple[int, int]:
        # Each sequence wastes at most one partly filled tile: T // BLOCK_Q + B tiles
        # cover every layout of T tokens over B sequences.
        return (num_tokens // (meta["BLOCK_M"] // group_pad) + num_seqs, num_kv_heads)

    k_scale, v_scale, *scale_strides = scale_args(k_cache, kv_scales)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * LOG2_E,
        num_seqs,
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
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=dot_tile(head_dim),
        BLOCK_SIZE=block_size,
        UPCAST=UPCAST_LOADS,
        QUANTIZED=kv_scales is not None,
    )
    return out
