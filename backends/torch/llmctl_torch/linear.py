"""Linear layers with a swappable weight format (a "weight method", as vLLM's LinearMethod).

``Linear`` is an ``nn.Linear`` whose forward asks its ``method`` for the product:

- ``UNQUANTIZED``: the weight in the model dtype, ``dense_linear``;
- ``INT8_WEIGHTS`` (``quantization=int8``): the weight quantized once, at load, to int8
  with a float32 scale per output channel (``llmctl.engine.quant``); the product reads
  the int8 weight, a quarter of fp32's bytes: on CUDA through the Triton GEMM in
  ``triton_int8_linear.py``; on the CPU through torch's ``_weight_int8pack_mm`` for
  decode-sized products (see ``_cpu_int8_matmul`` for its limits), else by
  dequantizing the layer's weight for the call.
- ``NativeMethod`` (either weight format, on the CPU where turbo's ops serve the
  attention too, ``attention_ops``): the weight packed once, at load, for turbo's
  ``linear`` kernel, which runs the product on turbo's own threads.

A layer that splits its weight across ranks (tensor parallelism) subclasses ``Linear``
and calls ``self.method.apply(self, x, bias)`` where it would call ``F.linear``, so a
sharded weight is quantized like any other: ``quantize_linears`` walks every ``Linear``.
The LM head and the embeddings are not ``Linear``s: they keep the model dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.quant import (
    QuantizationReport,
    dequantize_weight_int8,
    quantize_weight_int8,
    tensor_bytes,
)
from llmctl_torch.cpu_threads import product

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear``; on the CPU in float32, through oneDNN's inner product where torch
    has it (``mkldnn._linear_pointwise``, the op Inductor's CPU passes use): at the
    shapes of a step it was 1.2-1.6x faster than ``F.linear``'s MKL GEMM on an AMD host
    and level with it on an Intel one; it also takes a weight packed for it
    (``UnquantizedMethod``). Only without autograd: the op has none. On the CPU a step's
    large products take all its threads (``cpu_threads``)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    macs = x.numel() // x.shape[-1] * weight.numel()
    weight_bytes = weight.numel() * weight.element_size()
    if (
        x.dtype == torch.float32
        and _ONEDNN
        and not (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return product(macs, weight_bytes, _onednn_linear, x, weight, bias)
    return product(macs, weight_bytes, F.linear, x, weight, bias)


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# The rows oneDNN packs a weight for (its blocking may follow the rows a product has);
# any count runs on the packed weight, and the blockings measured alike from 1 to 1,024.
PACKED_FOR_ROWS = 64


class UnquantizedMethod:
    """The checkpoint's weight in the model dtype. On the CPU in float32 it is packed
    once, at load, into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, as
    Inductor's CPU weight prepacking does), so the product does not reorder it on every
    call: a 24M model's decode steps ran 5-13 % faster and its prefill 5 %
    (docs/benchmarks.md). The packed weight is an opaque ``torch._mkldnn`` tensor of
    the same shape and size, which only ``dense_linear`` reads."""

    name = "none"

    def process_weights(self, layer: Linear) -> None:
        weight = layer.weight
        if _ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
            layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)


class Int8WeightMethod:
    """Weight-only int8: ``layer.weight`` int8 ``[out, in]``, ``layer.weight_scale`` float32
    ``[out]``; activations and outputs stay in the model dtype."""

    name = "int8"

    def process_weights(self, layer: Linear) -> None:
        qweight, scale = quantize_weight_int8(layer.weight.detach())
        layer.weight = nn.Parameter(qweight, requires_grad=False)
        layer.register_buffer("weight_scale", scale)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = int8_matmul(x, layer.weight, layer.weight_scale)
        return out if bias is None else out + bias


class NativeMethod:
    """turbo's CPU kernels: the weight packed once, at load, into the panels turbo's
    ``linear`` op reads (``pack_linear_weight``, see its ``csrc/kernels.h``), in the model
    dtype (float32 or bfloat16) or, for ``int8``, quantized per output channel as
    ``Int8WeightMethod`` does (turbo's ``pack_int8_linear``; ``weight_scale`` packed
    alike). The product runs on turbo's thread pool, which waits for work by spinning
    briefly: a small step's products start at once, where torch's OpenMP threads sleep
    between regions (``llmctl/__init__.py``) and take about 0.1 ms each to wake. A 24M
    model's decode steps of 1 to 64 sequences took 1-6 ms less than on oneDNN's packed
    weights (of 9-32 ms); its prefill products about 10 % more (docs/benchmarks.md).

    ``layer.weight`` becomes the packed ``[panels, in, 16]`` tensor, which only this
    method reads; ``layer.out_features`` keeps the output size."""

    def __init__(self, name: str) -> None:
        self.name = name

    def process_weights(self, layer: Linear) -> None:
        from llmctl_turbo.build import load_ops
        from llmctl_turbo.runner import pack_int8_linear

        weight = layer.weight.detach()
        if self.name == "int8":
            packed, scale = pack_int8_linear(weight)
            layer.register_buffer("weight_scale", scale)
        else:
            packed = load_ops().pack_linear_weight(weight)
        layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty(rows.shape[0], layer.out_features)
        scale = layer.weight_scale if self.name == "int8" else None
        bias = _NO_TENSOR if bias is None else bias
        torch.ops.llmctl_turbo.linear(out, rows, layer.weight, bias, scale)
        return out.view(*x.shape[:-1], layer.out_features)


# turbo's ops take an empty tensor for "no bias".
_NO_TENSOR = torch.empty(0)

UNQUANTIZED = UnquantizedMethod()
INT8_WEIGHTS = Int8WeightMethod()
WEIGHT_METHODS = {method.name: method for method in (UNQUANTIZED, INT8_WEIGHTS)}
NATIVE_METHODS = {name: NativeMethod(name) for name in WEIGHT_METHODS}
# The model dtypes turbo's CPU kernels compute in.
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class Linear(nn.Linear):
    """``nn.Linear`` whose product its weight ``method`` computes (see the module doc)."""

    method: UnquantizedMethod | Int8WeightMethod | NativeMethod = UNQUANTIZED
    # Its LoRA slots (llmctl_torch.lora.LoraLayer), once the runner serves an adapter:
    # the adapters of the step's rows add to the base product, whatever its method.
    lora: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        lora = self.lora
        if lora is not None and lora.context.active:
            lora.apply(x, out)
        return out


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T`` in ``x``'s dtype.

    ``x: [..., in]``, ``qweight: int8 [out, in]``, ``scale: float32 [out]``. On CUDA the
    Triton kernel; on the CPU see ``_cpu_int8_matmul``."""
    if x.device.type == "cuda":
        from llmctl_torch.triton_int8_linear import int8_linear

        return int8_linear(x, qweight, scale)
    rows = x.reshape(-1, x.shape[-1])
    return _cpu_int8_matmul(rows, qweight, scale).view(*x.shape[:-1], qweight.shape[0])


# torch's CPU int8 kernel is a matrix-vector product: it beats fp32's read of the weights
# for a few rows (decode), but its cost grows with every row, so prefill dequantizes.
CPU_INT8_KERNEL_MAX_ROWS = 8


def _cpu_int8_matmul(
    rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The CPU product. A few rows go through ``torch._weight_int8pack_mm``, which reads
    the int8 weight directly; only its bfloat16 path is vectorised (its float32 one is
    scalar, 10x slower than fp32's own product), so the rows are rounded to bfloat16
    for it and its bfloat16 result is scaled in fp32 (the scales are kept out of it:
    bfloat16 scales would be off by up to 0.4 % per channel). It also crashes on
    shapes its vector loops do not cover, so it is used only on aligned ones. Other
    products dequantize the weight for this call and use the ordinary matmul."""
    num_out, num_in = qweight.shape
    if rows.shape[0] <= CPU_INT8_KERNEL_MAX_ROWS and num_in % 16 == 0 and num_out % 8 == 0:
        unscaled = product(
            rows.shape[0] * qweight.numel(),
            qweight.numel(),  # one byte an element
            torch._weight_int8pack_mm,
            rows.to(torch.bfloat16),
            qweight,
            _ones(num_out),
        )
        return torch.mul(unscaled, scale).to(rows.dtype)  # bf16 * fp32: computed in fp32
    return dense_linear(rows, dequantize_weight_int8(qweight, scale, rows.dtype))


@functools.cache
def _ones(size: int) -> torch.Tensor:
    """Unit bfloat16 scales for ``_weight_int8pack_mm`` (the real ones are applied after)."""
    return torch.ones(size, dtype=torch.bfloat16)


def quantize_linears(
    model: nn.Module, method_name: str, native: bool = False
) -> QuantizationReport | None:
    """Give every ``Linear`` of ``model`` the weight method ``method_name`` (``none`` or
    ``int8``), turbo's (``native``) or torch's, converting its weight in place, layer by
    layer with a progress bar; log and return how much memory that saved (``None`` for
    ``none``, which only packs)."""
    from rich.progress import track

    method = (NATIVE_METHODS if native else WEIGHT_METHODS)[method_name]
    layers = [module for module in model.modules() if isinstance(module, Linear)]
    if method_name == "none":
        for layer in layers:
            method.process_weights(layer)
            layer.method = method
        return None
    before = after = 0
    for layer in track(layers, description=f"quantizing weights to {method.name}", transient=True):
        before += _tensor_bytes(layer)
        method.process_weights(layer)
        layer.method = method
        after += _tensor_bytes(layer)
    report = QuantizationReport(len(layers), before, after)
    report.log()
    return report


def _tensor_bytes(module: nn.Module) -> int:
    return tensor_bytes(*module.parameters(recurse=False), *module.buffers(recurse=False))
