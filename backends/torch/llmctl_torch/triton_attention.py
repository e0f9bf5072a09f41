"""Triton paged attention for the torch backend: the three functions the model calls.

The ``AttentionOps`` of ``attention.py``, with the signatures of its plain-torch
implementation; ``attention.attention_ops`` picks one of three (Triton, plain torch,
turbo's C++ ops: ``LLMCTL_TORCH_ATTENTION=triton|torch|native``). The cache of one layer is a
pair ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``; a token in
cache slot ``s`` lives at ``[s // block_size, s % block_size]``.

- ``write_kv`` stores new tokens' K/V in their slots;
- ``paged_decode_attention`` and ``paged_prefill_attention`` read them back. Both run
  the same online-softmax step over a tile of cached tokens (``attend_kv_tile``), whose
  K/V loads dequantize an int8 or fp8 cache (``load_kv_rows``).

Without CUDA the kernels run through the Triton interpreter (see ``triton_common.py``).

Decode. Decode is bound by memory bandwidth: every step reads each sequence's whole K/V once.
So the kernel is shaped around reading the cache well:

- one program per (sequence, KV head, split): the query heads that share a KV head
  (a GQA group) are processed together, so each K/V element is read once per step;
- split-K: a long context is cut into splits handled by separate programs, so a small
  batch still spreads over every SM. Each split keeps its own online softmax and writes a
  partial output plus its log-sum-exp; a second, tiny kernel combines the splits;
- each loop step loads a tile of ``TILE_N`` tokens as whole ``head_dim`` rows, looked
  up token by token in the block table, so any block size works with any tile size.

Prefill. The new tokens of sequence ``b`` are the last ``q_len`` of its ``context_len`` cached
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

import functools

import torch

from llmctl.engine.quant import QUANT_MAX, SCALE_DTYPE, is_quantized_kv
from llmctl_torch.attention import KVScales
from llmctl_torch.config import TRITON_MAX_HEAD_DIM, block_size_problem
from llmctl_torch.triton_common import UPCAST_LOADS, dot_tile, tl, triton, tuning_configs

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]


MAX_HEAD_DIM = TRITON_MAX_HEAD_DIM  # the torch backend's model rule refuses larger heads
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels' softmax works in base 2 (exp2 is what the hardware has): scores are
# scaled by log2(e) once, folded into the attention scale.
LOG2_E = 1.4426950408889634


def check_paged_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: KVScales = None
) -> tuple[int, int, int]:
    """Validate a layer's paged cache pair (and the scales of an int8 / fp8 cache) and
    return ``(block_size, num_kv_heads, head_dim)``."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must have the same shape [num_blocks, block_size, "
            f"num_kv_heads, head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError(
            f"k_cache ({k_cache.dtype}, {k_cache.device}) and v_cache "
            f"({v_cache.dtype}, {v_cache.device}) must share a dtype and a device"
        )
    if is_quantized_kv(k_cache.dtype):
        _check_scales(k_cache, kv_scales)
    elif k_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(
            "the KV cache dtype must be float16, bfloat16 or float32 (or int8 / "
            f"float8_e4m3fn with scales), not {k_cache.dtype}"
        )
    elif kv_scales is not None:
        raise ValueError(f"kv_scales belong to an int8 or fp8 cache, not a {k_cache.dtype} one")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        # The kernels compute one set of offsets for both, and load whole head_dim rows.
        raise ValueError(
            "k_cache and v_cache must have the same strides and a contiguous last "
            f"(head_dim) dimension, got {k_cache.stride()} and {v_cache.stride()}"
        )
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if problem := block_size_problem(block_size):
        raise ValueError(f"block size {block_size}: {problem}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is outside the supported 1..{MAX_HEAD_DIM}")
    return block_size, num_kv_heads, head_dim


def _check_scales(k_cache: torch.Tensor, kv_scales: KVScales) -> None:
    expected = tuple(k_cache.shape[:3])
    if kv_scales is None:
        raise ValueError(
            f"a {k_cache.dtype} KV cache needs its scales: kv_scales=(k_scale, v_scale), "
            f"float32 {list(expected)}"
        )
    k_scale, v_scale = kv_scales
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.shape != expected or scale.dtype != SCALE_DTYPE or scale.device != k_cache.device:
            raise ValueError(
                f"{name} must be float32 {list(expected)} on {k_cache.device} (one scale per "
                f"token and KV head), got {scale.dtype} {list(scale.shape)} on {scale.device}"
            )
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must have the same strides")


def scale_args(k_cache: torch.Tensor, kv_scales: KVScales) -> tuple:
    """The kernels' scale arguments: ``(k_scale, v_scale, stride_block, stride_token,
    stride_head)``; for a float cache, the cache itself as an unused pointer and zeros."""
    if kv_scales is None:
        return (k_cache, k_cache, 0, 0, 0)
    k_scale, v_scale = kv_scales
    return (k_scale, v_scale, *k_scale.stride())


def check_query(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Validate ``q: [tokens, num_heads, head_dim]`` against the cache; return the group size."""
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(
            f"q must be [tokens, num_heads, {head_dim}] to match the cache's head_dim, "
            f"got {tuple(q.shape)}"
        )
    if q.device != k_cache.device or not (
        q.dtype == k_cache.dtype or (is_quantized_kv(k_cache.dtype) and q.dtype in FLOAT_DTYPES)
    ):
        raise ValueError(
            f"q ({q.dtype}, {q.device}) must have the KV cache's dtype and device "
            f"({k_cache.dtype}, {k_cache.device}); an int8 / fp8 cache takes a float16, "
            "bfloat16 or float32 q"
        )
    if q.stride(-1) != 1:
        raise ValueError("q's last (head_dim) dimension must be contiguous")
    num_heads = q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads: "
            "the query head count must be a multiple of the KV head count"
        )
    return num_heads // num_kv_heads


def index_tensor(
    name: str, t: torch.Tensor, dims: int, device: torch.device, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Check an index tensor (block tables, lengths, slots) and return it contiguous in
    ``dtype``, the layout the kernels read (a no-op when it already is)."""
    if t.dim() != dims or t.dtype not in (torch.int32, torch.int64) or t.device != device:
        raise ValueError(
            f"{name} must be a {dims}-d int32/int64 tensor on {device}, "
            f"got {t.dim()}-d {t.dtype} on {t.device}"
        )
    return t.to(dtype).contiguous()


@triton.jit
def load_kv_rows(
    cache_ptr,
    scale_ptr,
    offsets,
    scale_offsets,
    mask,
    valid,
    UPCAST: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """K or V rows at ``offsets`` as floats: an int8 / fp8 cache's rows times their scale
    (one per token and head, at ``scale_offsets``), computed in fp32. The one place the
    kernels dequantize; ``llmctl.engine.quant.dequantize_kv`` is its reference."""
    rows = tl.load(cache_ptr + offsets, mask=mask, other=0.0)
    if QUANTIZED:
        scale = tl.load(scale_ptr + scale_offsets, mask=valid, other=0.0)
        rows = rows.to(tl.float32) * scale[:, None]
    elif UPCAST:
        rows = rows.to(tl.float32)
    return rows


@triton.jit
def attend_kv_tile(
    q,
    m,
    l,  # noqa: E741
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
    visible,
    qk_scale,
    stride_cache_block,
    stride_cache_token,
    stride_scale_block,
    stride_scale_token,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """One step of the online softmax both kernels run (in base 2: ``qk_scale`` holds
    log2(e)): load the K/V rows of positions ``pos`` (the ``valid`` ones) through the
    block table (dequantized to ``q``'s dtype for an int8 / fp8 cache), score them
    against the rows of ``q``, keep the ``visible`` scores and fold them into the
    running max ``m``, sum ``l`` and output ``acc``."""
    block = tl.load(block_table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = (pos % BLOCK_SIZE).to(tl.int64)
    offsets = (block * stride_cache_block + slot * stride_cache_token)[:, None] + head_offset
    scale_offsets = block * stride_scale_block + slot * stride_scale_token + scale_head_offset
    kv_mask = valid[:, None] & dim_mask[None, :]
    k = load_kv_rows(
        k_cache_ptr, k_scale_ptr, offsets, scale_offsets, kv_mask, valid, UPCAST, QUANTIZED
    )
    v = load_kv_rows(
        v_cache_ptr, v_scale_ptr, offsets, scale_offsets, kv_mask, valid, UPCAST, QUANTIZED
    )
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)  # noqa: E741
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l, acc


# Writing K/V.


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


# Decode: one query token per sequence, split-K.

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


# Prefill: a chunk of query tokens per sequence.

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
