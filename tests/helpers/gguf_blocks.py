"""Fresh random GGUF block matrices and their float64 dequantize-then-matmul reference,
for turbo's CUDA GGUF kernel (emulated and on a GPU).

Q8_0 / Q4_0 / Q4_1 come from ``gguf.quants.quantize`` of random floats. gguf-py has no
quantizer for the K-quants, so their blocks are random bytes (every scale, min, nibble
and high bit drawn) with d / dmin set to random normal fp16 values; the reference is
``gguf.quants.dequantize`` of the same bytes either way.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

# The types turbo's CUDA kernel runs (csrc/gguf_types.h), by name.
CUDA_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of each K-quant block's fp16 scales (d, and dmin where there is one).
K_QUANT_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def block_geometry(name: str) -> tuple[int, int]:
    """(weights, bytes) of one block of GGML type ``name``."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[name]]


def random_gguf_rows(name: str, features: int, in_features: int, seed: int) -> torch.Tensor:
    """A random ``[features, in_features]`` matrix of ``name`` blocks as a GGUF file stores
    it: uint8 ``[features, row bytes]``."""
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[name]
    if name not in K_QUANT_SCALE_OFFSETS:
        floats = rng.standard_normal((features, in_features), dtype=np.float32)
        return torch.from_numpy(quantize(floats, kind))
    weights, size = block_geometry(name)
    blocks = rng.integers(0, 256, (features, in_features // weights, size), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[name]:
        # d ~ 1 / 64: the 6-bit scales then give weights of order 1.
        scale = (rng.standard_normal(blocks.shape[:2]) / 64).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scale[..., None].view(np.uint8)
    return torch.from_numpy(blocks.reshape(features, -1))


def dequantized(rows: torch.Tensor, name: str) -> torch.Tensor:
    """gguf.quants' float32 dequantization of ``rows``, ``[features, in_features]``."""
    return torch.from_numpy(dequantize(rows.numpy(), GGMLQuantizationType[name]))


def magnitude_tolerance(tolerance: dict, expected: torch.Tensor) -> dict:
    """``tolerance`` (a dtype's rtol / atol) with its absolute part scaled to the outputs'
    magnitude (sums of hundreds of order-1 products), so that it bounds summation order
    and the output's rounding, not the size of K."""
    scale = max(1.0, expected.abs().max().item())
    return dict(rtol=tolerance["rtol"], atol=tolerance["atol"] * scale)


def reference_linear(x: torch.Tensor, rows: torch.Tensor, name: str, bias=None) -> torch.Tensor:
    """x @ dequantize(rows)^T (+ bias) in float64."""
    out = x.double() @ dequantized(rows, name).double().T
    return out if bias is None else out + bias.double()
