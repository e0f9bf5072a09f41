"""Quantize and dequantize in plain torch: the one definition every backend and test uses.

Two schemes, both symmetric (zero maps to zero, no offsets):

- weights (``quantization=int8``): int8 with one float32 scale per output channel
  (row of an ``[out, in]`` matrix), ``w ≈ q * scale[row]``, ``scale = max|row| / 127``;
- KV cache (``kv_cache_dtype=int8|fp8``): one float32 scale per token and KV head
  (a ``head_dim`` row), stored beside the blocks. int8: ``scale = max|row| / 127``;
  fp8 (e4m3): ``scale = max|row| / 448``, the largest finite e4m3 value.

A scale per row keeps one outlier from costing precision everywhere else; per token
means a cache slot is quantized once, when its token is written, and never again.
Kernels (Triton, C++) quantize and dequantize the same way and are tested against
these functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmctl.kv_budget import format_bytes

INT8_MAX = 127.0
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The largest magnitude each quantized type stores: a row's maximum maps to it.
QUANT_MAX = {torch.int8: INT8_MAX, torch.float8_e4m3fn: FP8_MAX}
SCALE_DTYPE = torch.float32


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight: [out, in]`` → ``(int8 [out, in], float32 scale [out])``, per output channel."""
    if weight.dim() != 2:
        raise ValueError(f"a weight to quantize must be [out, in], got {tuple(weight.shape)}")
    return _quantize_rows(weight, torch.int8)


def dequantize_weight_int8(
    qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The ``dtype`` weight an int8 one stands for: ``qweight * scale[:, None]``."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


@dataclass(frozen=True)
class QuantizationReport:
    """What quantizing a model's linear layers saved: logged by every backend alike."""

    layers: int
    bytes_before: int
    bytes_after: int

    def describe(self) -> str:
        saved = self.bytes_before - self.bytes_after
        return (
            f"{self.layers} linear layers quantized to int8: {format_bytes(self.bytes_before)} "
            f"-> {format_bytes(self.bytes_after)} (saved {format_bytes(saved)}, "
            f"{saved / max(self.bytes_before, 1):.0%} of their weights)"
        )

    def log(self) -> None:
        logging.getLogger("llmctl").info("quantization: %s", self.describe())


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache for a ``kv_cache_dtype`` option value."""
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of this element type carries scales."""
    return dtype in QUANT_MAX


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [..., head_dim]`` → ``(dtype [..., head_dim], float32 scale [...])``: one scale
    per token and head (``dtype`` is ``torch.int8`` or ``torch.float8_e4m3fn``)."""
    if not is_quantized_kv(dtype):
        raise ValueError(f"no KV quantization to {dtype}: use torch.int8 or torch.float8_e4m3fn")
    return _quantize_rows(x, dtype)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q: [..., head_dim]`` with ``scale: [...]`` → ``dtype``, computed in float32."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def _quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of each last-dimension row to ``dtype`` (int8 or fp8 e4m3).

    An all-zero row gets scale 1 (any scale reproduces it), never 0, so dequantizing
    never divides by or multiplies into nothing unexpected."""
    limit = QUANT_MAX[dtype]
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax)).to(SCALE_DTYPE)
    scaled = x32 / scale[..., None]
    if dtype == torch.int8:
        q = scaled.round_().clamp_(-limit, limit).to(torch.int8)
    else:  # e4m3 rounds to nearest itself; clamp guards the rounding of amax / scale
        q = scaled.clamp_(-limit, limit).to(dtype)
    return q, scale
