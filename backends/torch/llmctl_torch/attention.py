"""Paged attention: the kernel interface, its plain-torch implementation, and dispatch.

The KV cache of one layer is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]``. A sequence's tokens live in the blocks its block table lists, in order;
token ``p`` of sequence ``b`` is at ``block_tables[b, p // block_size]``, offset
``p % block_size``.

Three functions make the interface (``AttentionOps``); ``triton_attention.py`` and turbo's
CPU kernels (``native_kernels``, below) implement the same three, with the same signatures:

- ``write_kv(k, v, k_cache, v_cache, slot_mapping)``: store new tokens' K/V at their
  slots (``block * block_size + offset``).
- ``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)``:
  one query per sequence, attending to its whole context.
- ``paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
  context_lens, scale)``: the queries of sequence ``b`` are
  ``q[query_start_loc[b]:query_start_loc[b + 1]]``, the last ``q_len`` tokens of its
  context (their K/V already written); query ``i`` sits at position
  ``context_lens[b] - q_len + i`` and attends causally to positions ``0..that``.

An int8 or fp8 cache (``kv_cache_dtype``) comes with ``kv_scales = (k_scale, v_scale)``,
float32 ``[num_blocks, block_size, num_kv_heads]``: one scale per token and KV head
(``llmctl.engine.quant``). Every function takes them as the keyword ``kv_scales``
(``None`` for a float cache): ``write_kv`` quantizes, the attention functions
dequantize what they read, to ``q``'s dtype.

Cache slots nobody has written yet must hold finite values (the runner allocates the
cache zeroed): the decode path reads whole blocks and gives the slots past a
sequence's end zero weight, and 0 * NaN would still be NaN.

Dispatch: ``LLMCTL_TORCH_ATTENTION=triton|native|torch`` forces one; by default Triton
on CUDA, and on the CPU turbo's native ops (``torch.ops.llmctl_turbo``, see
``native_kernels``) when llmctl-turbo is installed, its ops build here and the cache is
not fp8 (they read float and int8 caches), else plain torch. The others' modules are
imported only when chosen. Where the native ops serve attention, the runner runs its
linear layers (``linear.NativeMethod``) and LoRA adapters on turbo's kernels too.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmctl.engine.quant import dequantize_kv, quantize_kv
from llmctl.errors import BackendError, OptionError
from llmctl_torch.cpu_threads import threaded

ENV_VAR = "LLMCTL_TORCH_ATTENTION"
# Each choice's implementation of the three functions.
MODULES = {
    "torch": __name__,
    "triton": "llmctl_torch.triton_attention",
}
CHOICES = (*MODULES, "native")
logger = logging.getLogger("llmctl")


# (k_scale, v_scale) of an int8 / fp8 cache: float32 [num_blocks, block_size, num_kv_heads]
KVScales = tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class AttentionOps:
    """One implementation's three kernels (see the module docstring), each with the
    signature of the plain-torch function of the same name below; an int8 / fp8 cache's
    scales always come as the keyword ``kv_scales``."""

    name: str  # torch, triton or native
    write_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    # Starts the kernels' own threads, if they keep any, as many as torch's thread count in
    # the calling thread (turbo's start at their first use otherwise, with the count then).
    start_threads: Callable[[], object] = lambda: None


class LayerCache(NamedTuple):
    """One layer's paged KV cache, as the model passes it to the functions here."""

    k: torch.Tensor
    v: torch.Tensor
    scales: KVScales = None  # an int8 / fp8 cache's


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scales: KVScales = None,
) -> None:
    """Store ``k, v: [T, Hkv, D]`` at ``slot_mapping: [T]`` in the caches (quantized, with
    their scales, for an int8 / fp8 cache)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    scales = kv_scales or (None, None)
    for x, cache, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        if scale is None:
            cache.view(flat_shape).index_copy_(0, slot_mapping, x.to(cache.dtype))
        else:
            quantized, row_scales = quantize_kv(x, cache.dtype)
            # As bytes: torch has no index_copy_ for float8 on the CPU.
            raw = cache.view(torch.uint8).view(flat_shape)
            raw.index_copy_(0, slot_mapping, quantized.view(torch.uint8))
            scale.view(flat_shape[:2]).index_copy_(0, slot_mapping, row_scales)


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
    """``q: [B, Hq, D]`` → ``[B, Hq, D]``: each query attends to its sequence's context."""
    k_blocks, v_blocks = _read_blocks(k_cache, v_cache, kv_scales, block_tables, q.dtype)
    # [B, Hkv, max_blocks * block_size, D]: each sequence's blocks laid end to end
    keys = k_blocks.flatten(1, 2).transpose(1, 2)
    values = v_blocks.flatten(1, 2).transpose(1, 2)
    visible = torch.arange(keys.shape[2], device=q.device) < context_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


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
    """``q: [T, Hq, D]`` (sequences concatenated) → ``[T, Hq, D]``, causal within each."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    # Sequences with one new token (decodes mixed into a prefill step) go through the
    # batched decode path; the multi-token ones get one dense attention each.
    single = [b for b, n in enumerate(query_lens) if n == 1]
    if single:
        rows = query_start_loc[single].long()
        index = torch.tensor(single, device=q.device)
        out[rows] = paged_decode_attention(
            q[rows],
            k_cache,
            v_cache,
            block_tables[index],
            context_lens[index],
            scale,
            kv_scales=kv_scales,
        )
    block_size = k_cache.shape[1]
    for b, ctx_len in enumerate(context_lens.tolist()):
        q_len = query_lens[b]
        if q_len <= 1:
            continue
        blocks = block_tables[b, : -(-ctx_len // block_size)]
        k_blocks, v_blocks = _read_blocks(k_cache, v_cache, kv_scales, blocks, q.dtype)
        keys = k_blocks.flatten(0, 1)[:ctx_len].transpose(0, 1)  # [Hkv, L, D]
        values = v_blocks.flatten(0, 1)[:ctx_len].transpose(0, 1)
        rows = slice(starts[b], starts[b + 1])
        out[rows] = _causal_attention(q[rows].transpose(0, 1), keys, values, scale).transpose(0, 1)
    return out


def _causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``q: [Hq, Q, D]``, the last Q positions of ``keys: [Hkv, L, D]``."""
    q_len, ctx_len = q.shape[1], keys.shape[1]
    if q_len == ctx_len:  # the whole sequence: SDPA's own (top-left aligned) causal mask
        return F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    # A later chunk: query i sits at position ctx_len - q_len + i.
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
    visible = torch.arange(ctx_len, device=q.device)[None, :] <= query_pos[:, None]
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True
    )


def _read_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: KVScales,
    blocks: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache blocks ``blocks`` (any index shape) of K and V, dequantized to ``dtype``
    when the cache is int8 / fp8: the one place this path dequantizes."""
    if kv_scales is None:
        return k_cache[blocks], v_cache[blocks]
    k_scale, v_scale = kv_scales
    return (
        dequantize_kv(k_cache[blocks], k_scale[blocks], dtype),
        dequantize_kv(v_cache[blocks], v_scale[blocks], dtype),
    )


def attention_ops(device: torch.device | str, kv_dtype: torch.dtype | None = None) -> AttentionOps:
    """The three kernels to use on ``device`` for a cache of ``kv_dtype``: Triton on
    CUDA; on the CPU turbo's native ops where they build and read ``kv_dtype``, else plain
    torch; unless ``LLMCTL_TORCH_ATTENTION`` names one."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice and choice not in CHOICES:
        raise OptionError(f"{ENV_VAR}={choice!r}: use {', '.join(CHOICES)} (or leave it unset)")
    if not choice:
        if torch.device(device).type == "cuda":
            choice = "triton"
        else:
            choice = "native" if native_problem(kv_dtype) is None else "torch"
    elif choice == "native" and (problem := native_problem(kv_dtype)):
        raise OptionError(f"{ENV_VAR}=native: {problem}")
    if choice == "native":
        return native_kernels()
    module = importlib.import_module(MODULES[choice])
    # Plain torch's attention is made of products: all of a CPU step's threads (cpu_threads).
    attend = threaded if choice == "torch" else lambda fn: fn
    return AttentionOps(
        name=choice,
        write_kv=module.write_kv,
        paged_decode_attention=attend(module.paged_decode_attention),
        paged_prefill_attention=attend(module.paged_prefill_attention),
    )


def native_kernels() -> AttentionOps:
    """turbo's CPU attention kernels (its ``csrc/kernels.h``) in this interface. They read
    each sequence's keys and values in place, from its own blocks, so the cost follows
    the real context lengths. The ops write into outputs the caller passes, take index
    tensors as int32 and a cache's scales as two arguments (none for a float cache)."""
    from llmctl_turbo.build import load_ops

    ops = load_ops()

    def write_kv(k, v, k_cache, v_cache, slot_mapping, *, kv_scales=None) -> None:
        scales = kv_scales or (None, None)
        ops.write_kv_cache(k, v, k_cache, v_cache, slot_mapping.to(torch.int32), *scales)

    def into_new_output(op: Callable[..., None]) -> Callable[..., torch.Tensor]:
        """``op(out, q, *inputs, k_scale, v_scale)`` as ``attend(q, *inputs, kv_scales=)``."""

        def attend(q: torch.Tensor, *inputs: object, kv_scales: KVScales = None) -> torch.Tensor:
            out = torch.empty_like(q)
            op(out, q, *inputs, *(kv_scales or (None, None)))
            return out

        return attend

    return AttentionOps(
        name="native",
        write_kv=write_kv,
        paged_decode_attention=into_new_output(ops.paged_decode_attention),
        paged_prefill_attention=into_new_output(ops.paged_prefill_attention),
        start_threads=ops.cpu_threads,
    )


def native_problem(kv_dtype: torch.dtype | None = None) -> str | None:
    """Why turbo's native ops cannot serve a cache of ``kv_dtype`` here (``None``: they
    can; built if needed)."""
    if kv_dtype == torch.float8_e4m3fn:
        return "turbo's attention ops read float and int8 caches, not fp8"
    try:
        from llmctl_turbo.build import load_ops
    except ImportError:
        return "llmctl-turbo is not installed"
    try:
        load_ops()
    except BackendError as exc:
        logger.info("torch backend: plain-torch attention on the CPU (%s)", exc)
        return str(exc)
    return None
