"""What the Triton attention kernels share: the interpreter switch, tile sizes, input checks,
and the one online-softmax step (``attend_kv_tile``), whose K/V loads dequantize an int8
or fp8 cache (``load_kv_rows``).

Import ``triton`` and ``tl`` from here, never directly: on a machine without CUDA,
Triton can only run kernels through its interpreter, and it decides between compiling
and interpreting when ``@triton.jit`` runs (at import, for our kernels and for
triton.language's own helpers), by reading ``TRITON_INTERPRET``. Setting the variable
here, before triton is first imported, is what lets the same kernels run (slowly, in
numpy) on a CPU-only machine. ``TRITON_INTERPRET=0`` keeps the kernels compiled even
without a GPU: they can then be compiled ahead of time for a GPU target, not run.
"""

from __future__ import annotations

import os
import sys

import torch

from llmctl.engine.quant import SCALE_DTYPE, is_quantized_kv
from llmctl_torch.attention import KVScales
from llmctl_torch.config import TRITON_MAX_HEAD_DIM, block_size_problem

_ASKED = os.environ.get("TRITON_INTERPRET")  # "1" or "0" decides; unset: by the hardware
INTERPRET = _ASKED == "1" or (_ASKED != "0" and not torch.cuda.is_available())
if INTERPRET and _ASKED != "1":
    if "triton" in sys.modules:
        # triton.language's own helpers (tl.zeros, tl.max, ...) were then made for the
        # compiler, and an interpreted kernel calling them fails.
        raise RuntimeError(
            "the Triton attention kernels can only run through Triton's interpreter here "
            "(no CUDA GPU), but triton was imported before it could be switched on (torch "
            "imports triton lazily, e.g. for torch.compile). Set TRITON_INTERPRET=1 before "
            "starting Python, import llmctl_torch.triton_attention first, or use "
            "LLMCTL_TORCH_ATTENTION=torch."
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (must come after the interpreter switch above)
import triton.language as tl  # noqa: E402

__all__ = [
    "INTERPRET",
    "LOG2_E",
    "UPCAST_LOADS",
    "attend_kv_tile",
    "index_tensor",
    "check_paged_cache",
    "load_kv_rows",
    "scale_args",
    "check_query",
    "dot_tile",
    "tl",
    "triton",
    "tuning_configs",
]

MAX_HEAD_DIM = TRITON_MAX_HEAD_DIM  # the torch backend's model rule refuses larger heads
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels' softmax works in base 2 (exp2 is what the hardware has): scores are
# scaled by log2(e) once, folded into the attention scale.
LOG2_E = 1.4426950408889634

# The interpreter stores bfloat16 through numpy without bfloat16 arithmetic and gets it
# wrong, so interpreted kernels convert every load to fp32 and convert back at store.
UPCAST_LOADS = INTERPRET


def dot_tile(n: int) -> int:
    """A power of two >= n and >= 16: `tl.dot` needs every dimension of at least 16."""
    return max(16, triton.next_power_of_2(n))


def tuning_configs(
    gpu: list[tuple[dict[str, int], int, int]], interpreted: dict[str, int]
) -> list[triton.Config]:
    """Autotune candidates ``(kwargs, num_warps, num_stages)`` on a GPU; one config when
    interpreting, since the interpreter's timings mean nothing and benchmarking is slow."""
    if INTERPRET:
        return [triton.Config(interpreted, num_warps=1, num_stages=1)]
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in gpu]


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
