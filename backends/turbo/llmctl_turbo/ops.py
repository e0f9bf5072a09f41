"""turbo's CPU paged-attention ops in the torch backend's attention-ops convention.

``llmctl_torch.attention.AttentionOps``: the same three functions, with an int8 cache's
scales as the keyword ``kv_scales = (k_scale, v_scale)`` (float32 ``[num_blocks,
block_size, kv_heads]``; ``None`` for a float cache). The torch backend runs them on the
CPU (``LLMCTL_TORCH_ATTENTION=native``, its default where turbo's ops build): they read
each sequence's keys and values in place, from its own blocks, so the cost follows the
real context lengths. They allocate the outputs and call ``torch.ops.llmctl_turbo``,
whose kernels write into tensors the caller passes; index tensors are int32. Shapes and
semantics: ``csrc/kernels.h``.
"""

from __future__ import annotations

import torch

from llmctl_turbo.build import load_ops

KVScales = tuple[torch.Tensor, torch.Tensor] | None


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scales: KVScales = None,
) -> None:
    """Store ``k, v: [T, Hkv, D]`` at ``slot_mapping: [T]`` (an int8 cache is quantized as
    ``llmctl.engine.quant.quantize_kv`` does, with its scales)."""
    load_ops().write_kv_cache(
        k, v, k_cache, v_cache, slot_mapping.to(torch.int32), *(kv_scales or (None, None))
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
) -> torch.Tensor:
    return _attention("paged_decode_attention", q, k_cache, v_cache, block_tables, context_lens,
                      scale, kv_scales)  # fmt: skip


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
    return _attention("paged_prefill_attention", q, k_cache, v_cache, block_tables,
                      query_start_loc, context_lens, scale, kv_scales)  # fmt: skip


def _attention(op: str, q: torch.Tensor, *args: object) -> torch.Tensor:
    """Call turbo's attention ``op`` into a new output like ``q``; the last of ``args`` is
    ``kv_scales``, passed to the op as its two scale tensors (``None``: a float cache)."""
    out = torch.empty_like(q)
    *inputs, kv_scales = args
    getattr(load_ops(), op)(out, q, *inputs, *(kv_scales or (None, None)))
    return out
