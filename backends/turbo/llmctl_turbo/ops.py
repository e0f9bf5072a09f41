"""Python wrappers of turbo's native ops: allocate the outputs, call ``torch.ops.llmctl_turbo``.

The native ops write into tensors the caller passes (so the step can reuse buffers);
these wrappers are the convenient form for tests, benchmarks and the GPU check. All
index tensors are int32. Shapes and semantics: ``csrc/kernels.h``.

An int8 KV cache (``kv_cache_dtype=int8``) comes with its float32 scales
``k_scale`` / ``v_scale`` (``[num_blocks, block_size, kv_heads]``); a float cache with none.
"""

from __future__ import annotations

import torch

from llmctl_turbo.build import load_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    load_ops().rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place; returns ``rms_norm(residual)``."""
    out = torch.empty_like(x)
    load_ops().add_rms_norm(out, residual, x, weight, eps)
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` in place."""
    load_ops().rotary_embedding(positions, q, k, cos_sin_cache)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    load_ops().silu_and_mul(out, gate_up)
    return out


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    load_ops().write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    load_ops().paged_decode_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    load_ops().paged_prefill_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        k_scale,
        v_scale,
    )
    return out


def rotary_embedding_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``rotary_embedding`` then ``write_kv_cache`` of the rotated k and v (one kernel on
    CUDA)."""
    load_ops().rotary_embedding_and_write_kv(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
    )
