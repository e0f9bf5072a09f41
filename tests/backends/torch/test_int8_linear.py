"""int8-weight linear layers: every product path against a plain-torch reference that
dequantizes the weight first (``llmctl.engine.quant``) and multiplies in float64.

Tolerances, from what each path rounds:

- a float32 product over ``K`` terms: |error| <= K * 2^-24 * sum|x * w| roughly; we
  allow ``1e-5 * sum|x * w|`` per output (about 170 ulps at K = 1024);
- the CPU int8 kernel (``_weight_int8pack_mm``) rounds the rows to bfloat16 first (the
  reference does the same) and its result to bfloat16: relative 2^-8 of the output,
  plus the accumulation's part, so ``5e-3 * sum|x * w|``;
- bfloat16 activations (Triton): the output is rounded to bfloat16, ``8e-3 * sum|x * w|``.

``sum|x * w|`` (the sum of the magnitudes of the products) bounds the rounding of any
accumulation order, so outputs near zero are not held to an impossible relative bound.
"""

from __future__ import annotations

import pytest
import torch
from llmctl_torch import linear
from llmctl_torch.linear import INT8_WEIGHTS, Linear, int8_matmul, quantize_linears
from llmctl_torch.model import build_model

from llmctl.engine.quant import dequantize_weight_int8, quantize_weight_int8
from llmctl.model.config import ModelConfig
from llmctl.model.weights import load_weights

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def case(rows: int, out_features: int, in_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g) * torch.rand(
        out_features, 1, generator=g
    )
    qweight, scale = quantize_weight_int8(weight)
    return x, qweight, scale


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor):
    """The product in float64 over the dequantized weight, and sum|x * w| per output."""
    w = dequantize_weight_int8(qweight, scale, torch.float64)
    x = x.double()
    return x @ w.T, x.abs() @ w.abs().T


def assert_within(out: torch.Tensor, x_used: torch.Tensor, qweight, scale, relative: float):
    assert not out.isnan().any()
    expected, magnitude = reference(x_used, qweight, scale)
    error = (out.double().cpu() - expected).abs()
    assert (error <= relative * magnitude + 1e-30).all(), float((error / magnitude).max())


# (rows, out_features, in_features): decode rows with aligned shapes take the int8
# kernel; more rows, or shapes it does not cover (in % 16, out % 8), dequantize.
CPU_SHAPES = [(1, 64, 64), (3, 344, 64), (8, 128, 1408), (1, 40, 176), (9, 64, 64), (5, 7, 13)]


@pytest.mark.parametrize("rows,out_features,in_features", CPU_SHAPES)
def test_cpu_product_matches_the_dequantized_reference(rows, out_features, in_features):
    x, qweight, scale = case(rows, out_features, in_features, seed=rows + in_features)
    out = int8_matmul(x, qweight, scale)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    kernel = (
        rows <= linear.CPU_INT8_KERNEL_MAX_ROWS and in_features % 16 == 0 and out_features % 8 == 0
    )
    if kernel:  # the int8 kernel multiplies bfloat16 rows
        assert_within(out, x.bfloat16(), qweight, scale, 5e-3)
    else:
        assert_within(out, x, qweight, scale, 1e-5)


def test_cpu_product_keeps_leading_dimensions_and_bfloat16():
    x, qweight, scale = case(6, 32, 48, seed=3)
    out = int8_matmul(x.view(2, 3, 48).bfloat16(), qweight, scale)
    assert out.shape == (2, 3, 32) and out.dtype == torch.bfloat16
    assert_within(out.view(6, 32), x.bfloat16(), qweight, scale, 8e-3)


# Small shapes: through the interpreter each program is slow.
TRITON_SHAPES = [(1, 48, 40), (5, 32, 100), (17, 40, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", TRITON_SHAPES)
def test_triton_gemm_matches_the_dequantized_reference(rows, out_features, in_features, dtype):
    from llmctl_torch.triton_int8_linear import int8_linear

    x, qweight, scale = case(rows, out_features, in_features, seed=out_features)
    x = x.to(dtype)
    out = int8_linear(x.to(DEVICE), qweight.to(DEVICE), scale.to(DEVICE))
    assert out.dtype == dtype and out.shape == (rows, out_features)
    assert_within(out, x, qweight, scale, 1e-5 if dtype == torch.float32 else 8e-3)


def test_triton_gemm_refuses_mismatched_inputs():
    from llmctl_torch.triton_int8_linear import int8_linear

    x, qweight, scale = case(2, 16, 32, seed=0)
    with pytest.raises(ValueError, match="must match qweight"):
        int8_linear(x[:, :16], qweight, scale)
    with pytest.raises(ValueError, match="int8"):
        int8_linear(x, qweight.float(), scale)


def test_quantize_linears_converts_the_layers_and_keeps_head_and_embeddings(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")  # untied LM head, q/k/v biases
    config = ModelConfig.from_dir(model_dir)
    model = build_model(load_weights(model_dir, torch.float32), config, "cpu")
    embed = model.model.embed_tokens.weight.clone()
    head = model.lm_head.weight.clone()
    qkv = model.model.layers[0].self_attn.qkv_proj
    weight, bias = qkv.weight.clone(), qkv.bias.clone()

    report = quantize_linears(model, "int8")

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert report.layers == len(linears) == 4 * config.num_layers
    assert all(m.method is INT8_WEIGHTS and m.weight.dtype == torch.int8 for m in linears)
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(model.lm_head.weight, head) and model.lm_head.weight.dtype == torch.float32
    # A quarter of the bytes, plus one float32 scale per output channel.
    assert report.bytes_after < 0.3 * report.bytes_before
    # The layer computes x W^T + b with the dequantized weight.
    q, s = quantize_weight_int8(weight)
    assert torch.equal(qkv.weight, q) and torch.equal(qkv.weight_scale, s)
    x = torch.randn(2, config.hidden_size)
    expected = x.double() @ dequantize_weight_int8(q, s, torch.float64).T + bias.double()
    torch.testing.assert_close(qkv(x).double(), expected, rtol=1e-2, atol=1e-2)
    assert quantize_linears(model, "none") is None
