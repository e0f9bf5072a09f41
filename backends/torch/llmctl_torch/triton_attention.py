"""Triton paged attention for the torch backend: the three functions the model calls.

The ``AttentionOps`` of ``attention.py``, with the signatures of its plain-torch
implementation; ``attention.attention_ops`` picks one of three (Triton, plain torch,
turbo's C++ ops: ``LLMCTL_TORCH_ATTENTION=triton|torch|native``). The cache of one layer is a
pair ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``; a token in
cache slot ``s`` lives at ``[s // block_size, s % block_size]``.

- ``write_kv`` stores new tokens' K/V in their slots (here);
- ``paged_decode_attention`` (``triton_decode.py``) and ``paged_prefill_attention``
  (``triton_prefill.py``) read them back.

Without CUDA the kernels run through the Triton interpreter (see ``triton_common.py``).
"""

from __future__ import annotations

import torch

from llmctl.engine.quant import QUANT_MAX
from llmctl_torch.triton_common import (
    KVScales,
    check_paged_cache,
    index_tensor,
    scale_args,
    tl,
    triton,
)
from llmctl_torch.triton_decode import paged_decode_attention
from llmctl_torch.triton_prefill import paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]


@triton.jit
def _store_rows(
    x,
    cache_ptr,
    scale_ptr,
    cache_offsets,
    scale_offsets,
    mask,
    head_mask,
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Store ``x: [heads, head_dim]`` (fp32) into the cache; with ``QMAX`` (127 for int8,
    448 for fp8 e4m3) quantize each head's row first and store its scale, as
    ``llmctl.engine.quant.quantize_kv`` does (``ROUND``: to integers, for int8)."""
    if QMAX > 0:
        amax = tl.max(tl.abs(x), 1)
        scale = tl.where(amax > 0.0, amax / QMAX, 1.0)
        x = tl.minimum(tl.maximum(x / scale[:, None], -QMAX), QMAX)
        if ROUND:  # half away from zero (.to(int8) truncates); torch rounds half to even
            x = tl.where(x >= 0.0, x + 0.5, x - 0.5)
        tl.store(scale_ptr + scale_offsets, scale, mask=head_mask)
    tl.store(cache_ptr + cache_offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_scale_block,
    stride_scale_token,
    stride_scale_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program per new token: store its [num_kv_heads, head_dim] K and V in its slot
    (quantized, with a scale per head, when ``QMAX`` > 0)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims < HEAD_DIM)[None, :]
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    cache_offsets = (
        block * stride_cache_block
        + offset * stride_cache_token
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    scale_offsets = block * stride_scale_block + offset * stride_scale_token
    scale_offsets += heads * stride_scale_head

    # Padding rows and columns load as 0, so they never raise a row's maximum.
    k_offsets = token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    v_offsets = token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    k = tl.load(k_ptr + k_offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + v_offsets, mask=mask, other=0.0).to(tl.float32)
    _store_rows(
        k, k_cache_ptr, k_scale_ptr, cache_offsets, scale_offsets, mask, head_mask, QMAX, ROUND
    )
    _store_rows(
        v, v_cache_ptr, v_scale_ptr, cache_offsets, scale_offsets, mask, head_mask, QMAX, ROUND
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scales: KVScales = None,
) -> None:
    """Store ``k, v: [tokens, num_kv_heads, head_dim]`` into cache slots ``slot_mapping:
    [tokens]`` (converted to the cache's dtype; quantized with a scale per token and
    head into ``kv_scales`` for an int8 / fp8 cache); tokens whose slot is negative
    (padding) are skipped."""
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache, kv_scales)
    slot_mapping = index_tensor("slot_mapping", slot_mapping, 1, k_cache.device, torch.int64)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(
            f"k and v must be [tokens, num_kv_heads, head_dim] = {expected} to match "
            f"slot_mapping and the cache, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if not (k.dtype.is_floating_point and v.dtype.is_floating_point):
        raise ValueError(f"k and v must be floating point, got {k.dtype} and {v.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have a contiguous last (head_dim) dimension")
    if k.device != k_cache.device or v.device != k_cache.device:
        raise ValueError(f"k and v must be on the cache's device {k_cache.device}")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    k_scale, v_scale, *scale_strides = scale_args(k_cache, kv_scales)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *scale_strides,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        QMAX=QUANT_MAX.get(k_cache.dtype, 0.0),
        ROUND=k_cache.dtype == torch.int8,
    )
