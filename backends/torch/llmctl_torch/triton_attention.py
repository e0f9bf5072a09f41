"""Triton paged attention for the torch backend: the three functions the model calls.

Same signatures as the plain-torch implementation in ``attention.py``, which picks one
or the other (``LLMCTL_TORCH_ATTENTION=triton|torch``). The cache of one layer is a
pair ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``; a token in
cache slot ``s`` lives at ``[s // block_size, s % block_size]``.

- ``write_kv`` stores new tokens' K/V in their slots (here);
- ``paged_decode_attention`` (``triton_decode.py``) and ``paged_prefill_attention``
  (``triton_prefill.py``) read them back.

Without CUDA the kernels run through the Triton interpreter (see ``triton_common.py``).
"""

from __future__ import annotations

import torch

from llmctl_torch.triton_common import (
    UPCAST_LOADS,
    check_paged_cache,
    index_tensor,
    tl,
    triton,
)
from llmctl_torch.triton_decode import paged_decode_attention
from llmctl_torch.triton_prefill import paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per new token: copy its [num_kv_heads, head_dim] K and V into its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_token
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )

    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v: [tokens, num_kv_heads, head_dim]`` into cache slots ``slot_mapping:
    [tokens]`` (converted to the cache's dtype); tokens whose slot is negative (padding)
    are skipped."""
    block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
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
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        UPCAST=UPCAST_LOADS,
    )
