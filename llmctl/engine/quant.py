"""Quantize and dequantize in plain torch: the one definition every backend and test uses.

The schemes:

- weights (``quantization=int8``): int8 with one float32 scale per output channel
  (row of an ``[out, in]`` matrix), ``w ≈ q * scale[row]``, ``scale = max|row| / 127``;
- group-wise weights (``quantization=int4``, and ``int8`` with a
  ``quantization_group_size``): one float16 scale per group of 32, 64 or 128 inputs of a
  row, written as GGUF's blocks of 32 so that the block kernels that run GGUF files run
  them too: int8 as Q8_0, symmetric int4 as Q4_0 (``w = d * (q - 8)``), int4 with a zero
  point as Q4_1 (``w = d * q + m``, ``m`` an offset per group). A group of 64 or 128 is
  2 or 4 consecutive blocks carrying the same scale;
- KV cache (``kv_cache_dtype=int8|fp8``): one float32 scale per token and KV head
  (a ``head_dim`` row), stored beside the blocks. int8: ``scale = max|row| / 127``;
  fp8 (e4m3): ``scale = max|row| / 448``, the largest finite e4m3 value. An int8 cache
  holds each row rotated first (``kv_rotation``), which both backends' models apply.

A scale per row keeps one outlier from costing precision everywhere else; per token
means a cache slot is quantized once, when its token is written, and never again.
Kernels (Triton, C++) quantize and dequantize the same way and are tested against
these functions.
"""

from __future__ import annotations

import logging
import math
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


# Inputs per GGUF block, and the group sizes group-wise quantization takes (whole blocks).
GGUF_BLOCK = 32
WEIGHT_GROUP_SIZES = (32, 64, 128)


def group_block_type(bits: int, zero_point: bool) -> str:
    """The GGUF block type (GGML's name) that holds ``bits``-bit groups."""
    if bits == 8 and not zero_point:
        return "Q8_0"
    if bits == 4:
        return "Q4_1" if zero_point else "Q4_0"
    raise ValueError(f"no group-wise {bits}-bit weights" + (" with a zero point" * zero_point))


def quantize_weight_groups(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    zero_point: bool = False,
    hessian: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight: [out, in]`` → its GGUF rows (uint8 ``[out, in / 32 * block bytes]``) of
    ``group_block_type(bits, zero_point)``, one scale (and minimum) per ``group_size``
    inputs. ``gguf.quants.dequantize`` reads them back.

    Q8_0's scale is ``max|w| / 127``, as llama.cpp's. A 4-bit group's scale (and
    minimum) is searched instead (``_int4_group_scales``): 16 levels are too few for the
    extremes to set them, so candidates that clip the extremes are tried, each refitted
    by least squares, and the one with the least squared error is kept (llama.cpp's
    K-quants search alike). ``q`` is then rounded against the float16 values stored.

    With ``hessian`` (``[in, in]``, the second moments of the matrix's inputs:
    ``llmctl.engine.calibration``) 4-bit weights are rounded by GPTQ (``_gptq_int4``).
    """
    group_block_type(bits, zero_point)  # refuses a combination with no block type
    if weight.dim() != 2:
        raise ValueError(f"a weight to quantize must be [out, in], got {tuple(weight.shape)}")
    out, inputs = weight.shape
    if group_size not in WEIGHT_GROUP_SIZES:
        raise ValueError(f"group size {group_size}: use one of {WEIGHT_GROUP_SIZES}")
    if inputs % group_size:
        raise ValueError(f"{inputs} inputs are not a multiple of the group size {group_size}")
    if hessian is not None and bits == 4:
        q, d, minimum = _gptq_int4(weight.float(), hessian, group_size, zero_point)
    else:
        q, d, minimum = _round_groups(weight.float(), bits, group_size, zero_point)
    blocks = inputs // GGUF_BLOCK
    per_group = group_size // GGUF_BLOCK

    def block_halves(h: torch.Tensor) -> torch.Tensor:  # [out, groups] fp16 → [out, blocks, 2]
        return (
            h.repeat_interleave(per_group, dim=1)
            .contiguous()
            .view(torch.uint8)
            .view(out, blocks, 2)
        )

    q = q.reshape(out, blocks, GGUF_BLOCK)
    if bits == 4:  # byte i: weight i in the low nibble, weight i + 16 in the high one
        q = q[..., :16] | (q[..., 16:] << 4)
    parts = [block_halves(d), *([block_halves(minimum)] if minimum is not None else []), q]
    return torch.cat(parts, dim=-1).reshape(out, -1)


def _scale_groups(
    w: torch.Tensor, bits: int, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w: [rows, groups, size]`` → each group's float16 scale (and minimum)."""
    if bits == 8:
        return _stored_scales(w.abs().amax(-1) / 127), None
    scales = [_int4_group_scales(rows, zero_point) for rows in w.split(_SEARCH_ROWS)]
    d = _stored_scales(torch.cat([scale for scale, _ in scales]))
    return d, torch.cat([low for _, low in scales]).half() if zero_point else None


def _stored_scales(d: torch.Tensor) -> torch.Tensor:
    """Scales as the blocks store them, float16, refusing one that overflows it."""
    stored = d.half()
    if not torch.isfinite(stored).all():
        raise ValueError("a weight group's scale overflows float16 (|w| > 65504 x 8)")
    return stored


def _codes(
    w: torch.Tensor, d: torch.Tensor, minimum: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """The stored quants of ``w [..., size]`` against float16 ``d`` (and ``minimum``)
    ``[...]``: int8 as uint8 bytes, 4-bit ones unsigned (Q4_0's offset by 8)."""
    if minimum is not None:
        w = w - minimum.float()[..., None]
    d32 = d.float()[..., None]
    scaled = torch.where(d32 != 0, w / torch.where(d32 != 0, d32, 1), 0).round_()
    if bits == 8:
        return scaled.clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    if minimum is not None:
        return scaled.clamp_(0, 15).to(torch.uint8)
    return (scaled + 8).clamp_(0, 15).to(torch.uint8)


def _dequantized(q: torch.Tensor, d: torch.Tensor, minimum: torch.Tensor | None) -> torch.Tensor:
    """The weights 4-bit codes stand for (``_codes``' inverse)."""
    if minimum is None:
        return d.float()[..., None] * (q.float() - 8)
    return d.float()[..., None] * q.float() + minimum.float()[..., None]


def _round_groups(
    weight: torch.Tensor, bits: int, group_size: int, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each weight rounded to its group's nearest level: ``(codes [out, in], d [out,
    groups], minimum or None)``."""
    out, inputs = weight.shape
    w = weight.reshape(out, inputs // group_size, group_size)
    d, minimum = _scale_groups(w, bits, zero_point)
    return _codes(w, d, minimum, bits).reshape(out, inputs), d, minimum


# GPTQ's damping: this share of H's mean diagonal is added to its diagonal, so that H
# inverts where inputs are dead or move together (the GPTQ paper's 1 %). On stories260K
# 0.3-10 % gave the same perplexity on held-out text (docs/quantization.md).
GPTQ_DAMPING = 0.01


def _gptq_int4(
    weight: torch.Tensor, hessian: torch.Tensor, group_size: int, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ (Frantar et al., 2022): the inputs are rounded one at a time, and each one's
    rounding error is taken up by the inputs not rounded yet, in the proportions that keep
    the layer's output error ``(W - Ŵ) H (W - Ŵ)ᵀ`` least for inputs whose second moments
    are ``H``. Returns ``_round_groups``' triple.

    The order, measured on stories260K's fixed text (docs/quantization.md): with a zero
    point the inputs go in order, each group's scale and minimum chosen when its turn
    comes, on its weights as the groups before left them, by what GPTQ's rounding of the
    group will cost (``_gptq_group_scales``; scales searched first cost 4.6 % of
    perplexity against 3.2 %); symmetric groups keep the scales searched on the weights
    as they are and take the inputs by decreasing second moment, "act order", so that the
    errors land on the inputs that matter least (in order: 6.6 % against 2.3 %)."""
    out, inputs = weight.shape
    if hessian.shape != (inputs, inputs):
        raise ValueError(f"a [{inputs}, {inputs}] hessian quantizes a [{out}, {inputs}] weight")
    groups = inputs // group_size
    w = weight.double()
    h = hessian.double().clone()
    h.diagonal().add_(GPTQ_DAMPING * h.diagonal().mean().clamp_min(1e-12))
    act_order = not zero_point
    if act_order:
        d, minimum = _scale_groups(weight.reshape(out, groups, group_size), 4, zero_point)
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
    else:  # each group's scales when its turn comes
        d = torch.empty(out, groups, dtype=torch.float16)
        minimum = torch.empty(out, groups, dtype=torch.float16)
        order = torch.arange(inputs)
        w = w.clone()
    # U: the upper Cholesky factor of H^-1. Row c of it, over U[c, c], is how input c's
    # error spreads over the inputs after it.
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.empty(out, inputs, dtype=torch.uint8)
    for first in range(0, inputs, group_size):  # group_size inputs at a time, in order
        end = first + group_size
        if not act_order:  # these inputs are one group
            group_d, group_min = _gptq_group_scales(w[:, first:end], u[first:end, first:end])
            d[:, first // group_size], minimum[:, first // group_size] = group_d, group_min
        errors = torch.empty(out, group_size, dtype=w.dtype)
        for column in range(first, end):
            index = int(order[column])
            scale = d[:, index // group_size]
            low = None if minimum is None else minimum[:, index // group_size]
            q = _codes(w[:, column, None].float(), scale, low, 4)[:, 0]
            codes[:, index] = q
            rounded = _dequantized(q[:, None], scale, low)[:, 0].double()
            error = (w[:, column] - rounded) / u[column, column]
            errors[:, column - first] = error
            w[:, column + 1 : end] -= error[:, None] * u[column, column + 1 : end][None, :]
        w[:, end:] -= errors @ u[first:end, end:]
    return codes, d, minimum


# The search's candidates: the full range shrunk by these factors (1: llama.cpp's Q4_0 /
# Q4_1 scale); rows are searched a slice at a time to bound the memory it takes.
_SHRINK = torch.linspace(0.3, 1.0, 71)
_SEARCH_ROWS = 256


def _int4_group_scales(
    w: torch.Tensor, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w: [rows, groups, size]`` → each group's float32 scale ``d`` (and minimum ``m``
    with ``zero_point``) of least squared error over ``_int4_candidates``."""
    d, m, error = _int4_candidates(w, zero_point, _SHRINK)
    best = error.argmin(0, keepdim=True)
    return d.gather(0, best)[0], None if m is None else m.gather(0, best)[0]


def _int4_candidates(
    w: torch.Tensor, zero_point: bool, shrink: torch.Tensor, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``w: [rows, groups, size]`` → a candidate scale ``d`` (and minimum ``m``) per
    group for each factor of ``shrink``, with its squared error (each ``[candidates, rows,
    groups]``): ``w ≈ d * (q - 8)`` with ``q`` in 0..15 (symmetric, the candidates
    ``s * peak / -8``), or ``w ≈ d * q + m`` (the range ``[min, max]`` shrunk by ``s``
    about its centre). Each candidate's levels are refitted by least squares, input ``i``'s
    error weighed by ``weight[i]`` (``[size]``; 1 without)."""
    shrink = shrink.to(w.device)[:, None, None]
    a = torch.ones(w.shape[-1], device=w.device) if weight is None else weight
    if zero_point:
        low, high = w.amin(-1), w.amax(-1)
        span = (high - low)[None] * shrink
        d = span / 15
        m = (low + high)[None] / 2 - span / 2
        q = ((w[None] - m[..., None]) / torch.where(d > 0, d, 1)[..., None]).round_()
        q = q.clamp_(0, 15)
        # Least squares of w = d q + m over the group: two normal equations.
        n = a.sum()
        sum_q, sum_qq = (q * a).sum(-1), (q * q * a).sum(-1)
        sum_w, sum_wq = (w * a).sum(-1)[None], (q * w[None] * a).sum(-1)
        det = n * sum_qq - sum_q * sum_q
        fit = det > 1e-9 * n * sum_qq  # the levels are not all alike
        d = torch.where(fit, (n * sum_wq - sum_q * sum_w) / torch.where(fit, det, 1), d)
        m = torch.where(fit, (sum_w - d * sum_q) / n, sum_w / n)
        return d, m, ((d[..., None] * q + m[..., None] - w[None]).square_() * a).sum(-1)
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = peak[None] / -8 * shrink
    q = (w[None] / torch.where(d != 0, d, 1)[..., None]).round_().clamp_(-8, 7)
    qq = (q * q * a).sum(-1)
    d = torch.where(qq > 0, (q * w[None] * a).sum(-1) / torch.where(qq > 0, qq, 1), d)
    return d, None, ((d[..., None] * q - w[None]).square_() * a).sum(-1)


def _gptq_group_scales(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float16 scale and minimum (``[rows]``) for a zero-point group of GPTQ, ``w:
    [rows, size]`` as the groups before left it and ``u`` its block of ``U``: of
    ``_int4_candidates``, the one whose rounding of the group costs least as GPTQ counts
    it, ``Σ (error_c / U[c, c])²``, each input's value moved by the errors of the inputs
    before it (the candidates refitted with those weights, ``1 / U[c, c]²``). The group's
    plain least squared error chooses worse (held-out perplexity on stories260K: +3.7 %
    against +3.4 % in groups of 32, nine calibration seeds; +4.7 % against +4.3 % in
    groups of 64, six): the inputs rounded last take up the others' errors, and whether
    they still fit the range decides."""
    u = u.float()
    cost = u.diagonal().square().reciprocal()
    cost /= cost.mean()
    chosen = [_gptq_rounding_choice(rows.float(), u, cost) for rows in w.split(_SEARCH_ROWS)]
    d, m = (torch.cat(parts) for parts in zip(*chosen))
    return _stored_scales(d), m.half()


def _gptq_rounding_choice(
    w: torch.Tensor, u: torch.Tensor, cost: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_gptq_group_scales`` for a slice of rows, in float32."""
    d, m, _ = _int4_candidates(w[:, None], True, _SHRINK, cost)
    # [candidates, rows], as float16 stores them: the rounding is measured as it will be.
    d, m = d[..., 0].half().float(), m[..., 0].half().float()
    step = torch.where(d != 0, d, 1)
    errors = w.new_zeros(w.shape[1], *d.shape)
    # The rounding below is ``_codes`` then ``_dequantized`` (the same values, d = 0
    # included), written out: through those two, with their conversions to and from
    # bytes, the whole of GPTQ took 1.5x as long (1536 x 576: 0.65 s against 0.42 s).
    for column in range(w.shape[1]):
        value = w[:, column] - torch.tensordot(u[:column, column], errors[:column], dims=1)
        q = ((value - m) / step).round_().clamp_(0, 15)
        errors[column] = (value - (d * q + m)) / u[column, column]
    best = errors.square().sum(0).argmin(0, keepdim=True)
    return d.gather(0, best)[0], m.gather(0, best)[0]


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
    kind: str = "int8"  # what they became: "int8", "int4 (Q4_0 blocks, group 32)", ...

    def describe(self) -> str:
        saved = self.bytes_before - self.bytes_after
        return (
            f"{self.layers} linear layers quantized to {self.kind}: "
            f"{format_bytes(self.bytes_before)} "
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


def kv_rotation(
    head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | None:
    """The orthonormal Hadamard matrix ``H`` ([D, D], symmetric, ``H @ H = I``) that every
    head's query, key and value rows are multiplied by, after RoPE, when the KV cache is
    int8; ``None`` when ``head_dim`` is not a power of two (then nothing is rotated).

    ``q k^T = (q H)(k H)^T``, and attention over rotated values is the output times ``H``,
    undone by ``H`` again: exact in real arithmetic. What it buys: a row's largest value
    sets its int8 scale, and the rotation spreads one outlier over the whole row, so the
    other values get finer steps (as QuaRot does for whole models). Each runner builds
    it once, in the model dtype; turbo passes it to its native step."""
    if head_dim < 2 or head_dim & (head_dim - 1):
        return None
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < head_dim:  # Sylvester's construction
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return h.mul(1.0 / math.sqrt(head_dim)).to(dtype)


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
