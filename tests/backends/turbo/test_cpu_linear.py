"""turbo's own CPU linear kernels and their threads, against plain torch on random inputs.

Every instruction set this CPU supports is checked (the kernels are compiled for
AVX-512, AVX2 and portable code and pick one at run time), over the row counts a step
has (1 to 64 decode rows, and more for prefill), odd feature counts (partial weight
panels, vector tails), fp32 and bf16. Outputs are poisoned with NaN first, so a kernel
that leaves part of its output unwritten fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.backends.turbo.conftest import ISAS
from tests.helpers.kernel_refs import relative_error

DTYPES = [torch.float32, torch.bfloat16]
# Relative to the largest reference value: fp32 sums in another order; bf16 rounds the
# output (and, for silu, gate and up first) to 8 bits of mantissa.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
# (rows, in_features, out_features): decode batches, odd sizes, the 24M model's shapes,
# prefill-sized row counts that span several row blocks, and narrow outputs over many
# rows (stories260K's prefill), whose rows are split across threads as well as panels.
SHAPES = [
    (1, 64, 192),
    (1, 512, 1024),
    (2, 173, 37),
    (3, 16, 1),
    (7, 100, 15),
    (8, 64, 16),
    (9, 1408, 512),
    (17, 512, 2816),
    (33, 31, 50),
    (64, 512, 130),
    (150, 1024, 40),
    (600, 64, 48),
    (1000, 172, 64),
]


@pytest.fixture
def threads(turbo_ops):
    """Restores the thread count a test changes."""
    before = turbo_ops.cpu_threads()
    yield
    turbo_ops.set_cpu_threads(before)


def random_case(rows, in_features, out_features, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_matches_torch(turbo_ops, isa, dtype, shape):
    rows, _, out_features = shape
    x, weight, bias = random_case(*shape, dtype, seed=sum(shape))
    packed = turbo_ops.pack_linear_weight(weight)
    for b in (bias, bias[:0]):  # with a bias, and without (an empty tensor)
        out = torch.full((rows, out_features), float("nan"), dtype=dtype)
        turbo_ops.linear(out, x, packed, b)
        want = x.float() @ weight.float().T + (b.float() if b.numel() else 0)
        assert relative_error(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_silu_mul_matches_torch(turbo_ops, isa, dtype, shape):
    rows, in_features, intermediate = shape
    x, gate_up, _ = random_case(rows, in_features, 2 * intermediate, dtype, seed=sum(shape))
    out = torch.full((rows, intermediate), float("nan"), dtype=dtype)
    turbo_ops.linear_silu_mul(out, x, turbo_ops.pack_linear_weight(gate_up, 2))
    # As transformers computes it in the model dtype.
    gate, up = (x @ gate_up.T).split(intermediate, dim=-1)
    want = (F.silu(gate) * up).float()
    assert relative_error(out, want) < TOLERANCE[dtype]


def test_unpacked_weights_go_through_aten_with_the_same_result(turbo_ops):
    x, weight, bias = random_case(5, 96, 40, torch.float32, seed=3)
    packed_out, plain_out = torch.empty(5, 40), torch.empty(5, 40)
    turbo_ops.linear(packed_out, x, turbo_ops.pack_linear_weight(weight), bias)
    turbo_ops.linear(plain_out, x, weight, bias)
    torch.testing.assert_close(packed_out, plain_out, atol=1e-5, rtol=1e-5)


def test_packed_layout_holds_sixteen_features_per_panel(turbo_ops):
    weight = torch.randn(20, 3)
    packed = turbo_ops.pack_linear_weight(weight)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[1, :, :4], weight[16:].T)
    assert torch.equal(packed[1, :, 4:], torch.zeros(3, 12))  # padding
    # Two groups (gate, up) are padded separately, so panel p of each matches.
    packed = turbo_ops.pack_linear_weight(torch.randn(2 * 20, 3), 2)
    assert packed.shape == (4, 3, 16)


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", [(37, 512, 700), (600, 64, 48)], ids=["panels", "rows"])
def test_results_do_not_depend_on_the_thread_count(turbo_ops, threads, count, shape):
    """Each output is computed by one tile whatever the split (of the panels, or of the
    rows too where the panels are few): any thread count must give the same bits, and
    every chunk of every loop must run exactly once."""
    x, weight, bias = random_case(*shape, torch.float32, seed=9)
    packed = turbo_ops.pack_linear_weight(weight)
    turbo_ops.set_cpu_threads(1)
    want = torch.empty(shape[0], shape[2])
    turbo_ops.linear(want, x, packed, bias)
    turbo_ops.set_cpu_threads(count)
    assert turbo_ops.cpu_threads() == count
    for _ in range(20):  # many loops in a row: workers join late, sleep, wake
        got = torch.full((shape[0], shape[2]), float("nan"))
        turbo_ops.linear(got, x, packed, bias)
        assert torch.equal(got, want)


def test_bad_arguments_name_the_argument_and_the_rule(turbo_ops, threads):
    x = torch.randn(4, 32)
    weight = torch.randn(20, 32)
    out = torch.empty(4, 20)
    with pytest.raises(RuntimeError, match="weight must be packed by pack_linear_weight"):
        turbo_ops.linear(out, x, turbo_ops.pack_linear_weight(torch.randn(40, 32)), x[0, :0])
    with pytest.raises(RuntimeError, match="contiguous rows"):
        turbo_ops.linear(out, x, torch.randn(32, 20).T, x[0, :0])
    with pytest.raises(RuntimeError, match="input features"):
        turbo_ops.linear(out, torch.randn(4, 31), weight, x[0, :0])
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8"):
        turbo_ops.pack_linear_weight(weight.half())
    with pytest.raises(RuntimeError, match="groups"):
        turbo_ops.pack_linear_weight(torch.randn(21, 32), 2)
    with pytest.raises(RuntimeError, match="between 1 and 4096"):
        turbo_ops.set_cpu_threads(0)
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        turbo_ops.set_cpu_isa("avx9000")
    assert turbo_ops.cpu_isa() in ISAS
