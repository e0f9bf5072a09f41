"""Segmented LoRA matmuls in Triton (punica's SGMV idea), for a step that mixes adapters.

The step's adapted tokens are sorted by slot and cut into tiles of at most
``TILE_ROWS`` tokens of one slot (``LoraContext.prepare``): ``tiles`` is ``[3, n]``
int32, each tile's (slot, start, end) into ``tokens``, the token indices. Two kernels,
one program per (tile, column block):

- ``lora_shrink``: ``h[t] = A[slot] @ x[t]``, ``A: [slots, HR, K]`` (the parts' A
  stacked), ``h: [T, HR]`` in fp32 (rows of tokens without an adapter are left unset);
- ``lora_expand``: ``out[t, :] += B[slot] @ h[t, col : col + R]``, ``B: [slots, N, R]``,
  ``out`` a column slice of the layer's output (its row stride is the whole layer's).

A tile reads its slot's A or B tile once for up to ``TILE_ROWS`` tokens, so a decode
batch of one adapter reads each weight once, as a plain matmul would. Every tile's
tokens are distinct, so the expand kernel adds to ``out`` without atomics. Ranks are
padded to a power of two of at least 16 in registers (``tl.dot``'s smallest tile);
the slots' zeros past an adapter's rank add nothing.
"""

from __future__ import annotations

import torch

from llmctl_torch.triton_common import UPCAST_LOADS, dot_tile, tl, triton

# Rows of one tile: each tile's rows share one slot (LoraContext.prepare cuts them).
TILE_ROWS = 16


@triton.jit
def _tile_rows(tiles_ptr, tokens_ptr, num_tiles, BLOCK_M: tl.constexpr):
    """This program's tile (``tiles``: slots, then starts, then ends): its adapter slot,
    the rows (token indices) it covers, and which of its ``BLOCK_M`` rows are real."""
    tile = tl.program_id(0)
    slot = tl.load(tiles_ptr + tile).to(tl.int64)
    start = tl.load(tiles_ptr + num_tiles + tile)
    end = tl.load(tiles_ptr + 2 * num_tiles + tile)
    index = start + tl.arange(0, BLOCK_M)
    row_mask = index < end
    rows = tl.load(tokens_ptr + index, mask=row_mask, other=0).to(tl.int64)
    return slot, rows, row_mask


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    tokens_ptr,
    tiles_ptr,
    num_tiles,
    K,
    HR,
    stride_xm,
    stride_as,
    stride_ar,
    stride_hm,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot, rows, row_mask = _tile_rows(tiles_ptr, tokens_ptr, num_tiles, BLOCK_M)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < HR
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + slot * stride_as + ranks.to(tl.int64)[None, :] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows + ks[:, None], mask=k_mask[:, None] & rank_mask[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a.to(x.dtype), input_precision="ieee")
    tl.store(
        h_ptr + rows[:, None] * stride_hm + ranks[None, :],
        acc,
        mask=row_mask[:, None] & rank_mask[None, :],
    )


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    b_ptr,
    out_ptr,
    tokens_ptr,
    tiles_ptr,
    num_tiles,
    N,
    R,
    h_col,
    stride_hm,
    stride_bs,
    stride_bn,
    stride_om,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    slot, rows, row_mask = _tile_rows(tiles_ptr, tokens_ptr, num_tiles, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b_cols = b_ptr + slot * stride_bs + cols.to(tl.int64)[None, :] * stride_bn
    delta = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r_start in range(0, R, BLOCK_R):
        ranks = r_start + tl.arange(0, BLOCK_R)
        rank_mask = ranks < R
        h = tl.load(
            h_ptr + rows[:, None] * stride_hm + (h_col + ranks)[None, :],
            mask=row_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        b = tl.load(b_cols + ranks[:, None], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
        delta += tl.dot(h, b.to(tl.float32), input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    out = tl.load(out_ptrs, mask=mask, other=0.0)
    if UPCAST:
        out = out.to(tl.float32)
    tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, tiles: torch.Tensor):
    if weights.dim() != 3 or weights.stride(-1) != 1:
        raise ValueError(
            f"LoRA weights must be [slots, rows, cols] with contiguous rows, got "
            f"{tuple(weights.shape)}"
        )
    if tokens.dtype != torch.int32 or tiles.dtype != torch.int32 or tiles.shape[0] != 3:
        raise ValueError("tokens must be int32 and tiles int32 [3, num_tiles]")
    if not (x.device == weights.device == tokens.device == tiles.device):
        raise ValueError("inputs, weights, tokens and tiles must be on the same device")


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, tiles: torch.Tensor
) -> torch.Tensor:
    """``h[t] = a[slot(t)] @ x[t]`` for the tiles' tokens: ``x [T, K]``, ``a [slots, HR,
    K]`` -> ``h [T, HR]`` float32 (other rows unset)."""
    _check(x, a, tokens, tiles)
    num_tokens, num_in = x.shape
    if a.shape[2] != num_in or x.stride(-1) != 1:
        raise ValueError(f"x [T, {a.shape[2]}] (contiguous rows) expected, got {tuple(x.shape)}")
    hr = a.shape[1]
    h = torch.empty(num_tokens, hr, dtype=torch.float32, device=x.device)
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return h
    block_r = min(dot_tile(hr), 64)
    grid = (num_tiles, triton.cdiv(hr, block_r))
    _lora_shrink_kernel[grid](
        x, a, h, tokens, tiles, num_tiles, num_in, hr,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        UPCAST=UPCAST_LOADS, BLOCK_M=TILE_ROWS, BLOCK_R=block_r, BLOCK_K=32,
    )  # fmt: skip
    return h


def lora_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    h_col: int,
    tokens: torch.Tensor,
    tiles: torch.Tensor,
) -> None:
    """``out[t] += b[slot(t)] @ h[t, h_col : h_col + R]`` in place for the tiles' tokens:
    ``b [slots, N, R]``, ``out [T, N]`` (a column slice of a wider output is fine)."""
    _check(h, b, tokens, tiles)
    num_out, rank = b.shape[1], b.shape[2]
    if out.shape[1] != num_out or out.stride(-1) != 1 or h.dtype != torch.float32:
        raise ValueError(
            f"out [T, {num_out}] with contiguous columns and h float32 expected, got "
            f"{tuple(out.shape)} and {h.dtype}"
        )
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return
    block_n = 64
    grid = (num_tiles, triton.cdiv(num_out, block_n))
    _lora_expand_kernel[grid](
        h, b, out, tokens, tiles, num_tiles, num_out, rank, h_col,
        h.stride(0), b.stride(0), b.stride(1), out.stride(0),
        UPCAST=UPCAST_LOADS, BLOCK_M=TILE_ROWS, BLOCK_R=min(dot_tile(rank), 64), BLOCK_N=block_n,
    )  # fmt: skip
