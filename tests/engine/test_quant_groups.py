"""Group-wise weight quantization (``quantize_weight_groups``: int4 and group-wise int8 as
GGUF Q4_0 / Q4_1 / Q8_0 rows), read back by gguf's own ``dequantize``, not by llmctl code,
on fresh random matrices with a per-row offset (so a zero point has something to do)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmctl.engine.quant import group_block_type, quantize_weight_groups

SCHEMES = [(8, False), (4, False), (4, True)]  # (bits, zero point): Q8_0, Q4_0, Q4_1


def random_weight(out: int, inputs: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inputs, generator=generator) / 8
    return weight + torch.randn(out, 1, generator=generator) / 16


def round_to_nearest(w: np.ndarray, bits: int, zero_point: bool, group_size: int) -> np.ndarray:
    """``w`` quantized and dequantized by plain round-to-nearest over each group's full
    range, with float64 scales."""
    groups = w.reshape(w.shape[0], -1, group_size)
    if zero_point:
        low = groups.min(-1, keepdims=True)
        d = (groups.max(-1, keepdims=True) - low) / 15
        q = np.clip(np.round((groups - low) / np.where(d > 0, d, 1)), 0, 15)
        return (q * d + low).reshape(w.shape)
    if bits == 8:
        d = np.abs(groups).max(-1, keepdims=True) / 127
        return (np.round(groups / np.where(d > 0, d, 1)) * d).reshape(w.shape)
    index = np.abs(groups).argmax(-1)[..., None]
    d = np.take_along_axis(groups, index, -1) / -8
    q = np.clip(np.round(groups / np.where(d != 0, d, 1)), -8, 7)
    return (q * d).reshape(w.shape)


def read_back(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> np.ndarray:
    return dequantize(raw.numpy(), GGMLQuantizationType[kind]).reshape(shape).astype(np.float64)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize(("bits", "zero_point"), SCHEMES)
def test_groups_round_trip_through_gguf_dequantize(bits, zero_point, group_size):
    weight = random_weight(37, 256, seed=group_size + bits)
    kind = group_block_type(bits, zero_point)
    raw = quantize_weight_groups(weight, bits, group_size, zero_point)
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    assert raw.dtype == torch.uint8 and raw.shape == (37, 256 // 32 * block_bytes)
    got = read_back(raw, kind, (37, 256))
    w = weight.double().numpy()
    # No group is further from its weights, in squared error, than plain round-to-nearest
    # over its full range (llama.cpp's Q8_0 / Q4_0 / Q4_1 scale, computed here in float64):
    # the 4-bit search only keeps a scale that does better. The slack is the fp16 scale's
    # rounding, which moves an 8-bit group's fine grid by up to a few % of its error.
    error = np.square(got - w).reshape(37, -1, group_size).sum(-1)
    plain = np.square(round_to_nearest(w, bits, zero_point, group_size) - w)
    plain = plain.reshape(37, -1, group_size).sum(-1)
    assert (error <= plain * (1.15 if bits == 8 else 1.02)).all()
    assert error.sum() <= plain.sum() * (1.01 if bits == 8 else 0.97)
    # The scale is shared by every 32-block of a group: the fp16 d of consecutive blocks.
    d = raw.view(37, 256 // 32, block_bytes)[..., :2].contiguous().view(torch.float16)
    d = d.reshape(37, 256 // group_size, group_size // 32)
    assert (d == d[..., :1]).all()
    assert len(set(d[..., 0].flatten().tolist())) > 1  # and groups differ


@pytest.mark.parametrize(("bits", "zero_point"), SCHEMES)
def test_group_32_is_at_least_as_close_as_llama_cpp_rounding(bits, zero_point):
    """Groups of 32 are GGUF's own blocks: the searched scales (4-bit) and the rounding
    against the stored fp16 scale are never worse, in squared error, than gguf.quants."""
    weight = random_weight(64, 512, seed=3)
    kind = group_block_type(bits, zero_point)
    ours = read_back(quantize_weight_groups(weight, bits, 32, zero_point), kind, (64, 512))
    w = weight.numpy()
    theirs = read_back(torch.from_numpy(quantize(w, GGMLQuantizationType[kind])), kind, (64, 512))
    ours_error = np.square(ours - w).mean()
    theirs_error = np.square(theirs - w).mean()
    assert ours_error <= theirs_error * 1.001
    if bits == 4:
        assert ours_error < 0.97 * theirs_error  # the search earns its keep


def test_bad_groups_are_named():
    weight = random_weight(8, 96, seed=1)
    with pytest.raises(ValueError, match=r"group size 48: use one of \(32, 64, 128\)"):
        quantize_weight_groups(weight, 4, 48)
    with pytest.raises(ValueError, match="96 inputs are not a multiple of the group size 64"):
        quantize_weight_groups(weight, 4, 64)
    with pytest.raises(ValueError, match="no group-wise 8-bit weights with a zero point"):
        quantize_weight_groups(weight, 8, 32, zero_point=True)
    with pytest.raises(ValueError, match="overflows float16"):
        quantize_weight_groups(weight * 1e7, 4, 32)


def test_an_all_zero_group_stays_zero():
    weight = random_weight(4, 64, seed=2)
    weight[1, :32] = 0
    for bits, zero_point in SCHEMES:
        kind = group_block_type(bits, zero_point)
        got = read_back(quantize_weight_groups(weight, bits, 32, zero_point), kind, (4, 64))
        assert np.isfinite(got).all() and (got[1, :32] == 0).all()


def correlated_inputs(count: int, inputs: int, draw: int) -> torch.Tensor:
    """Inputs that move together (8 shared factors, mixed the same way for every
    ``draw``) and differ in size by feature, as a layer's do: GPTQ has something to use."""
    layer = torch.Generator().manual_seed(0)
    mixing = torch.randn(8, inputs, generator=layer)
    sizes = torch.rand(inputs, generator=layer).add(0.2)
    generator = torch.Generator().manual_seed(draw)
    factors = torch.randn(count, 8, generator=generator)
    return (factors @ mixing + 0.3 * torch.randn(count, inputs, generator=generator)) * sizes


def output_error(weight: torch.Tensor, raw: torch.Tensor, kind: str, x: torch.Tensor) -> float:
    """The mean squared error of ``x @ W.T`` with W read back from ``raw``."""
    got = torch.from_numpy(read_back(raw, kind, tuple(weight.shape)))
    return float((x.double() @ (weight.double() - got).T).square().mean())


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_point", [True, False])
def test_gptq_has_less_output_error_than_rounding_to_nearest(zero_point, group_size):
    """With ``hessian`` (the inputs' second moments), int4 rounds by GPTQ: on the inputs it
    was measured on, and on fresh ones drawn alike, the layer's outputs err less than with
    each weight rounded to its group's nearest level; the blocks are gguf's own."""
    weight = random_weight(48, 256, seed=group_size)
    x = correlated_inputs(2048, 256, draw=1)
    hessian = x.T @ x / len(x)
    kind = group_block_type(4, zero_point)
    gptq = quantize_weight_groups(weight, 4, group_size, zero_point, hessian)
    nearest = quantize_weight_groups(weight, 4, group_size, zero_point)
    assert gptq.shape == nearest.shape and not torch.equal(gptq, nearest)
    for inputs in (x, correlated_inputs(2048, 256, draw=2)):
        assert output_error(weight, gptq, kind, inputs) < 0.8 * output_error(
            weight, nearest, kind, inputs
        )


@pytest.mark.parametrize("zero_point", [True, False])
def test_gptq_with_independent_unit_inputs_rounds_to_nearest(zero_point):
    """H = I: no input's error can be taken up by another, so GPTQ rounds each weight to
    its group's nearest level. Symmetric groups keep the scales searched on the same
    weights: round-to-nearest's bytes exactly. A zero-point group's scale and minimum are
    chosen by the error of its weights rounded against the stored float16 values (the
    search ranks them by its least-squares fit): no group errs more than
    round-to-nearest's."""
    weight = random_weight(16, 128, seed=5)
    kind = group_block_type(4, zero_point)
    got = quantize_weight_groups(weight, 4, 32, zero_point, torch.eye(128))
    nearest = quantize_weight_groups(weight, 4, 32, zero_point)
    if not zero_point:
        assert torch.equal(got, nearest)
        return
    blocks = got.reshape(16, 4, 20)
    d, m = (blocks[..., i : i + 2].contiguous().view(torch.float16).float() for i in (0, 2))
    w = weight.reshape(16, 4, 32)
    codes = ((w - m) / d).round().clamp(0, 15)
    assert np.allclose(read_back(got, kind, (16, 128)), (codes * d + m).reshape(16, 128))
    w = weight.double().numpy()
    errors = [
        np.square(read_back(r, kind, (16, 128)) - w).reshape(16, 4, 32).sum(-1)
        for r in (got, nearest)
    ]
    assert (errors[0] <= errors[1] * (1 + 1e-6)).all()


def test_gptq_survives_dead_and_repeated_inputs():
    """Inputs that are always zero, or copies of another, leave H singular: the damping
    keeps it invertible and every weight finite."""
    weight = random_weight(8, 96, seed=6)
    x = correlated_inputs(512, 96, draw=3)
    x[:, 5] = 0
    x[:, 7] = x[:, 6]
    raw = quantize_weight_groups(weight, 4, 32, True, x.T @ x / len(x))
    assert np.isfinite(read_back(raw, "Q4_1", (8, 96))).all()
    with pytest.raises(ValueError, match=r"a \[96, 96\] hessian quantizes a \[8, 96\] weight"):
        quantize_weight_groups(weight, 4, 32, True, torch.eye(64))
