"""turbo's linear with ``argmax``: each row's first largest output, found while the kernel
writes the row (a greedy step's LM head), against ``torch.argmax`` of the same outputs.

Every weight kind the LM head can be (packed fp32 and bf16, int8, GGUF blocks, and a
checkpoint matrix through ATen), every instruction set, one thread and two (so rows are
split into chunks that merge), row counts of decode and prefill steps, vocabularies that
leave partial panels and vector tails. Ties are exact (two equal weight rows lifted above
the rest by the bias, far apart so different chunks find them), and NaN and -inf rows
follow torch's rules (the first NaN; all -inf gives 0).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from llmctl.engine.quant import quantize_weight_int8

# (rows, in_features, vocab): one decode row, odd batches, a prefill, vocabularies with a
# partial 16-wide panel and a partial vector.
SHAPES = [
    (1, 64, 1),
    (3, 64, 37),
    (17, 96, 512),
    (64, 64, 1003),
    (130, 32, 4099),
    (700, 64, 40),  # few panels, many rows: chunks of rows scan their own rows
]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request, turbo_ops):
    before = turbo_ops.cpu_threads()
    turbo_ops.set_cpu_threads(request.param)
    yield request.param
    turbo_ops.set_cpu_threads(before)


def random_case(rows, in_features, vocab, seed):
    """x, a float32 weight and a bias. Two weight rows far apart are zero and their bias
    40, so those two outputs are exactly 40 whatever the order of the sums: the largest
    in the first half of the rows (an exact tie), not in the second, whose x is scaled up."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(vocab, in_features, generator=generator) / 8
    bias = torch.randn(vocab, generator=generator)
    if vocab > 2:
        first, second = vocab // 5, vocab - 2
        weight[first] = weight[second] = 0.0
        bias[first] = bias[second] = 40.0
        x[-(rows // 2) or rows :] *= 1000
    return x, weight, bias


def weight_kinds(turbo_ops, weight: torch.Tensor):
    """(name, x dtype, weight as the op takes it, its scale) for each kind an LM head is."""
    qweight, scale = quantize_weight_int8(weight)
    int8_scale = turbo_ops.pack_linear_weight(scale[:, None]).flatten()
    kinds = [
        ("float32", torch.float32, turbo_ops.pack_linear_weight(weight), None),
        ("bfloat16", torch.bfloat16, turbo_ops.pack_linear_weight(weight.bfloat16()), None),
        ("int8", torch.float32, turbo_ops.pack_linear_weight(qweight), int8_scale),
        ("float16-aten", torch.float16, weight.half(), None),
    ]
    if weight.shape[1] % 32 == 0:
        for name in ("Q8_0", "Q4_1"):
            raw = quantize(weight.numpy(), GGMLQuantizationType[name])
            packed = turbo_ops.pack_gguf_weight(
                torch.from_numpy(raw), int(GGMLQuantizationType[name])
            )
            kinds.append((name, torch.float32, packed, None))
    return kinds


def run_linear(turbo_ops, x, weight, bias, scale, with_argmax: bool):
    out = torch.full((x.shape[0], bias.shape[0]), float("nan"), dtype=x.dtype)
    ids = torch.full((x.shape[0],), -7, dtype=torch.int64) if with_argmax else None
    turbo_ops.linear(out, x, weight, bias, scale, ids)
    return out, ids


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_argmax_is_torch_argmax_of_the_same_outputs(turbo_ops, isa, threads, shape):
    x, weight, bias = random_case(*shape, seed=sum(shape))
    for name, dtype, packed, scale in weight_kinds(turbo_ops, weight):
        xs, b = x.to(dtype), bias.to(dtype)
        out, ids = run_linear(turbo_ops, xs, packed, b, scale, with_argmax=True)
        plain, _ = run_linear(turbo_ops, xs, packed, b, scale, with_argmax=False)
        assert torch.equal(out, plain), f"{name}: the outputs changed with argmax"
        want = torch.argmax(out.float(), dim=1)
        assert torch.equal(ids, want), f"{name}: {ids.tolist()} != {want.tolist()}"
        if shape[2] > 2:  # the tie: the first of the two equal outputs, where it is largest
            first, second = shape[2] // 5, shape[2] - 2
            tied = slice(0, shape[0] - shape[0] // 2)
            assert torch.equal(out[tied, first], out[tied, second]), name
            assert (ids[tied] == first).all(), name


def test_nan_and_infinite_rows_follow_torch(turbo_ops, threads):
    rows, in_features, vocab = 6, 64, 1003
    x, weight, bias = random_case(rows, in_features, vocab, seed=3)
    weight[700] = float("nan")  # column 700 is NaN in every row: the argmax everywhere
    x[1] = float("nan")  # row 1 all NaN: 0
    packed = turbo_ops.pack_linear_weight(weight)
    out, ids = run_linear(turbo_ops, x, packed, bias, None, with_argmax=True)
    assert ids.tolist() == torch.argmax(out, dim=1).tolist() == [700, 0, 700, 700, 700, 700]

    # Every output -inf (a finite product plus a -inf bias): torch's argmax is 0.
    ones = turbo_ops.pack_linear_weight(torch.ones(vocab, in_features))
    minus_inf = torch.full((vocab,), float("-inf"))
    out, ids = run_linear(turbo_ops, x[2:], ones, minus_inf, None, with_argmax=True)
    assert torch.isneginf(out).all()
    assert ids.tolist() == torch.argmax(out, dim=1).tolist() == [0, 0, 0, 0]


def test_argmax_output_is_checked_with_reasons(turbo_ops):
    x, weight, bias = random_case(4, 64, 37, seed=1)
    packed = turbo_ops.pack_linear_weight(weight)
    out = torch.empty(4, 37)
    with pytest.raises(RuntimeError, match="argmax must be Long"):
        turbo_ops.linear(out, x, packed, bias, None, torch.empty(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"argmax must be a contiguous \[4\] tensor"):
        turbo_ops.linear(out, x, packed, bias, None, torch.empty(5, dtype=torch.int64))
