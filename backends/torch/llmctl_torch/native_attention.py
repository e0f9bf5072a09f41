"""Paged attention on the CPU through turbo's native C++ ops, as plain torch ops.

turbo registers its kernels as ``torch.ops.llmctl_turbo.*``; on the CPU their paged
attention reads each sequence's keys and values in place, from its own blocks, so the
cost follows the real context lengths (the plain-torch path gathers every sequence's
blocks into a padded tensor at every layer and step, then runs masked SDPA over the
padding). The same three functions as ``attention.py``; used when llmctl-turbo is
installed and its ops build here (``attention.attention_ops`` decides).
"""

from __future__ import annotations

import torch
from llmctl_turbo import ops as turbo_ops

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
    """Store ``k, v: [T, Hkv, D]`` at ``slot_mapping: [T]`` (the native op takes int32;
    an int8 cache is quantized as ``quantize_kv`` does, with its scales)."""
    turbo_ops.write_kv_cache(
        k, v, k_cache, v_cache, slot_mapping.to(torch.int32), *(kv_scales or (None, None))
    )


def paged_decode_attention(*args, kv_scales: KVScales = None) -> torch.Tensor:
    return turbo_ops.paged_decode_attention(*args, *(kv_scales or (None, None)))


def paged_prefill_attention(*args, kv_scales: KVScales = None) -> torch.Tensor:
    return turbo_ops.paged_prefill_attention(*args, *(kv_scales or (None, None)))
