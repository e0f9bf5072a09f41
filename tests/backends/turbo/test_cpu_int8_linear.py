"""turbo's int8-weight CPU linear kernels (quantization=int8) against plain torch.

The weights are quantized by ``llmctl.engine.quant.quantize_weight_int8`` (the torch
backend's scheme) and the reference is ``x @ (q * scale[:, None]).T`` in float32, on
fresh random inputs: every instruction set this CPU supports, decode and prefill row
counts, odd feature counts (partial panels, vector tails), fp32 and bf16 activations.
Outputs are poisoned with NaN first, so a kernel that leaves part of its output
unwritten fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llmctl_turbo.runner import pack_int8_linear

from llmctl.engine.quant import dequantize_weight_int8, quantize_weight_int8
from tests.helpers.kernel_refs import relative_error

DTYPES = [torch.float32, torch.bfloat16]
# Relative to the largest reference value. fp32: the kernel sums x * q and scales the
# sum once, the reference sums x * (q * scale): the same terms rounded in another order.
# bf16: the output (and, for silu, gate and up first) is rounded to 8 bits of mantissa.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (rows, in_features, out_features): rows 1..64 (decode batches) and prefill counts (the
# last with few panels, so its rows are split across threads too); feature counts that
# are not multiples of 16 (partial panels, vector tails) beside the 24M model's shapes.
SHAPES = [
    (1, 64, 192),
    (1, 512, 1408),
    (2, 173, 37),
    (3, 16, 1),
    (5, 100, 15),
    (8, 64, 16),
    (13, 1408, 512),
    (17, 31, 50),
    (31, 512, 130),
    (64, 77, 203),
    (150, 96, 40),
    (700, 64, 40),
]


def random_int8_case(rows, in_features, out_features, dtype, seed):
    """x in ``dtype``; an int8 weight with its scales; the float32 weight it stands for."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    # Rows of different magnitudes, so that a wrong scale per channel shows.
    magnitude = torch.rand(out_features, 1, generator=generator) + 0.05
    weight = torch.randn(out_features, in_features, generator=generator) * magnitude
    qweight, scale = quantize_weight_int8(weight)
    return x, qweight, scale, dequantize_weight_int8(qweight, scale, torch.float32)


def pack(turbo_ops, qweight, scale, groups=1):
    """The kernels' layout of exactly this int8 weight and these scales."""
    packed_scale = turbo_ops.pack_linear_weight(scale[:, None], groups).flatten()
    return turbo_ops.pack_linear_weight(qweight, groups), packed_scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int8_linear_matches_torch(turbo_ops, isa, dtype, shape):
    rows, in_features, out_features = shape
    x, qweight, scale, weight = random_int8_case(*shape, dtype, seed=sum(shape))
    bias = torch.randn(out_features).to(dtype)
    packed, packed_scale = pack(turbo_ops, qweight, scale)
    for b in (bias, bias[:0]):  # with a bias, and without (an empty tensor)
        out = torch.full((rows, out_features), float("nan"), dtype=dtype)
        turbo_ops.linear(out, x, packed, b, packed_scale)
        want = x.float() @ weight.T + (b.float() if b.numel() else 0)
        assert relative_error(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int8_linear_silu_mul_matches_torch(turbo_ops, isa, dtype, shape):
    rows, in_features, intermediate = shape
    x, qweight, scale, weight = random_int8_case(
        rows, in_features, 2 * intermediate, dtype, seed=sum(shape)
    )
    packed, packed_scale = pack(turbo_ops, qweight, scale, groups=2)
    out = torch.full((rows, intermediate), float("nan"), dtype=dtype)
    turbo_ops.linear_silu_mul(out, x, packed, packed_scale)
    # As transformers computes it in the model dtype, from the dequantized weight.
    gate, up = (x.float() @ weight.T).to(dtype).split(intermediate, dim=-1)
    want = (F.silu(gate) * up).float()
    assert relative_error(out, want) < TOLERANCE[dtype]


def test_packing_quantizes_as_the_torch_backend_does(turbo_ops):
    """The packed int8 panels and scales are exactly quantize_weight_int8's, laid out as
    the float panels are (scales per panel column, padding zero)."""
    weight = torch.randn(2 * 20, 24)
    packed, scale = pack_int8_linear(weight, groups=2)
    qweight, want_scale = quantize_weight_int8(weight)
    assert packed.dtype == torch.int8 and packed.shape == (4, 24, 16)
    assert torch.equal(packed, turbo_ops.pack_linear_weight(qweight, 2))
    assert scale.shape == (4 * 16,)
    assert torch.equal(scale[:20], want_scale[:20])  # gate: panels 0-1
    assert torch.equal(scale[32:52], want_scale[20:])  # up: panels 2-3
    assert not scale[20:32].any() and not scale[52:].any()


def test_int8_arguments_are_checked_with_reasons(turbo_ops):
    x, qweight, scale, weight = random_int8_case(4, 32, 20, torch.float32, seed=1)
    packed, packed_scale = pack_int8_linear(weight)
    out, none = torch.empty(4, 20), x[0, :0]
    with pytest.raises(RuntimeError, match="is int8, so its scales must be .* got none"):
        turbo_ops.linear(out, x, packed, none)
    with pytest.raises(RuntimeError, match=r"scales must be a contiguous float32 \[32\]"):
        turbo_ops.linear(out, x, packed, none, packed_scale[:20])
    with pytest.raises(RuntimeError, match="scales go with int8 weights only"):
        turbo_ops.linear(out, x, turbo_ops.pack_linear_weight(weight), none, packed_scale)
    with pytest.raises(
        RuntimeError, match="on the CPU int8 weights run on turbo's CPU kernels, packed"
    ):
        turbo_ops.linear(out, x, qweight, none, scale)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8"):
        turbo_ops.pack_linear_weight(weight.half())
