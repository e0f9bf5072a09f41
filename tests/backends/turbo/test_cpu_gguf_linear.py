"""turbo's GGUF block kernels (quantization=gguf: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
K-quants Q4_K, Q5_K, Q6_K kept as blocks) against a dequantize-then-matmul reference in
float64, on fresh random blocks.

The Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks come from ``gguf.quants.quantize`` (llama.cpp's
own rounding) of random matrices; gguf-py cannot quantize K-quants, so theirs are random
valid block bytes (random quants, 6-bit / int8 sub-block scales and mins, random fp16
super-block scales: ``tests.gguf.gguf_files.random_k_blocks``). The reference weights come
from ``gguf.quants.dequantize``: never from turbo's packing. The kernels quantize
activations per 32-block to int8, as llama.cpp does, so each case is checked twice:
- against the same activation rounding done here in numpy (the kernel's arithmetic
  exactly, up to float32 sums): a tight tolerance that catches any layout slip;
- against unrounded activations: the error the 8-bit activations cost, bounded.
Every instruction set the CPU runs (avx512vnni's vpdpbusd path, and the portable
integer sums compiled for avx512 / avx2 / baseline), row counts 1-20 and 64 (decode
batches, a prefill), out features that leave a partial 16-wide panel, K a multiple of
32 (GGUF's block) but not of 64, for K-quants of 256 (their super-block) but not of 512.
Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.gguf.gguf_files import random_k_blocks

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
ROWS = [*range(1, 21), 64]
# (in_features, out_features): K = 32 x odd, N not a multiple of 16; SmolLM2's qkv.
SHAPES = [(32, 1), (96, 37), (224, 130), (576, 960)]
# K-quants: K = 256 x odd; N not a multiple of 16; SmolLM2's ffn_down (its Q4_K_M's Q6_K).
K_SHAPES = [(256, 1), (768, 37), (256, 130), (1536, 576)]
# Relative to the largest reference value.
EXACT_TOLERANCE = 2e-5  # the kernel's arithmetic, float32 sums in another order
ROUNDED_ACTIVATIONS_TOLERANCE = 3e-2  # int8 activations (max error 1/254 of a block's max)


def ggml_type(name: str) -> int:
    return int(GGMLQuantizationType[name])


def random_blocks(name: str, out_features: int, in_features: int, seed: int):
    """(raw GGUF rows uint8 [N, row bytes], their dequantized weights float64 [N, K])."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((out_features, in_features)).astype(np.float32) / 8
    weights += rng.standard_normal((out_features, 1)).astype(np.float32) / 16  # Q4_1's m
    if name in K_TYPES:
        raw = random_k_blocks((out_features, in_features), name, rng)
    else:
        raw = quantize(weights, GGMLQuantizationType[name])
    return raw, dequantize(raw, GGMLQuantizationType[name]).astype(np.float64)


def rounded_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it: per 32-block, dx = max|x| / 127, round(x * (1 / dx)) * dx
    (float32 like the kernel), as float64."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    dx = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    inverse = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    q = np.round(blocks * inverse)  # ties to even, as std::nearbyint
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(x.shape)


def check(out: torch.Tensor, x: np.ndarray, weights: np.ndarray, bias=None, act=None):
    got = out.double().numpy()
    assert np.isfinite(got).all(), "the kernel left outputs unwritten"
    for inputs, tolerance in (
        (rounded_activations(x), EXACT_TOLERANCE),
        (x.astype(np.float64), ROUNDED_ACTIVATIONS_TOLERANCE),
    ):
        ref = inputs @ weights.T
        if bias is not None:
            ref = ref + bias
        if act is not None:
            ref = act(ref)
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= tolerance * scale, (tolerance, np.abs(got - ref).max())


@pytest.fixture(params=["avx512vnni", "avx512", "avx2", "portable"])
def block_isa(request, turbo_ops):
    """Each instruction set this CPU supports, then the best again."""
    best = turbo_ops.cpu_isa()
    try:
        turbo_ops.set_cpu_isa(request.param)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    yield request.param
    turbo_ops.set_cpu_isa(best)


CASES = [(name, shape) for name in TYPES for shape in SHAPES] + [
    (name, shape) for name in K_TYPES for shape in K_SHAPES
]


@pytest.mark.parametrize(("name", "shape"), CASES, ids=[f"{n}-{k}x{m}" for n, (k, m) in CASES])
def test_block_linear_matches_dequantized_matmul(turbo_ops, block_isa, name, shape):
    in_features, out_features = shape
    raw, weights = random_blocks(name, out_features, in_features, seed=sum(shape))
    packed = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type(name))
    rng = np.random.default_rng(7)
    for rows in ROWS:
        x = rng.standard_normal((rows, in_features)).astype(np.float32)
        bias = rng.standard_normal(out_features).astype(np.float32)
        out = torch.full((rows, out_features), float("nan"))
        turbo_ops.linear(out, torch.from_numpy(x), packed, torch.from_numpy(bias), None)
        check(out, x, weights, bias=bias)


@pytest.mark.parametrize("name", TYPES + K_TYPES)
def test_block_linear_silu_mul(turbo_ops, block_isa, name):
    in_features, intermediate = (512 if name in K_TYPES else 160), 45
    raw, weights = random_blocks(name, 2 * intermediate, in_features, seed=3)
    packed = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type(name), 2)
    rng = np.random.default_rng(11)

    def silu_mul(both):
        gate, up = both[:, :intermediate], both[:, intermediate:]
        return gate / (1 + np.exp(-gate)) * up

    # The random K-quant weights are large (int8 scales up to 127): smaller inputs keep
    # the gate where silu bends.
    size = 0.01 if name in K_TYPES else 1.0
    for rows in (1, 5, 17, 64):
        x = (size * rng.standard_normal((rows, in_features))).astype(np.float32)
        out = torch.full((rows, intermediate), float("nan"))
        turbo_ops.linear_silu_mul(out, torch.from_numpy(x), packed, None)
        check(out, x, weights, act=silu_mul)


def test_block_linear_bfloat16_output(turbo_ops):
    raw, weights = random_blocks("Q4_1", 50, 128, seed=5)
    packed = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type("Q4_1"))
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = torch.full((9, 50), float("nan"), dtype=torch.bfloat16)
    turbo_ops.linear(out, x, packed, None, None)
    ref = rounded_activations(x.float().numpy()) @ weights.T
    assert np.abs(out.double().numpy() - ref).max() <= 1e-2 * np.abs(ref).max()


def test_bad_block_inputs_are_named(turbo_ops):
    raw, _ = random_blocks("Q8_0", 20, 64, seed=1)
    with pytest.raises(RuntimeError, match="GGML types 8 .Q8_0."):
        turbo_ops.pack_gguf_weight(torch.from_numpy(raw), 10)  # Q2_K: no kernel
    with pytest.raises(RuntimeError, match="row bytes a multiple of 34"):
        turbo_ops.pack_gguf_weight(torch.from_numpy(raw[:, :-1].copy()), ggml_type("Q8_0"))
    packed = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type("Q8_0"))
    with pytest.raises(RuntimeError, match="packed by pack_gguf_weight for 20 outputs and 96"):
        turbo_ops.linear(torch.empty(1, 20), torch.randn(1, 96), packed, None, None)


def test_k_quant_bad_inputs_are_named(turbo_ops):
    raw, _ = random_blocks("Q6_K", 20, 512, seed=1)
    with pytest.raises(RuntimeError, match="row bytes a multiple of 210"):
        turbo_ops.pack_gguf_weight(torch.from_numpy(raw[:, :-1].copy()), ggml_type("Q6_K"))
    packed = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type("Q6_K"))
    # Half a super-block: 128 inputs are no whole K-quant block.
    with pytest.raises(RuntimeError, match="packed by pack_gguf_weight for 20 outputs and 128"):
        turbo_ops.linear(torch.empty(1, 20), torch.randn(1, 128), packed[:, :4].contiguous(),
                         None, None)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "file_bits", "resident_bits"),
    [
        ("Q8_0", 8.5, 8.5),  # d alone: the zero point 128 is the layout's
        ("Q4_0", 4.5, 4.5),
        ("Q4_1", 5.0, 5.0),
        ("Q5_0", 5.5, 9.0),  # 5-bit quants a byte each
        ("Q4_K", 4.5, 4.625),
        ("Q5_K", 5.5, 8.625),
        ("Q6_K", 6.5625, 8.5625),
    ],
)
def test_resident_bytes(turbo_ops, name, file_bits, resident_bits):
    """Packed bytes per weight against the file's (docs/quantization.md states them)."""
    raw, _ = random_blocks(name, 64, 512, seed=4)
    packed = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type(name))
    assert raw.size * 8 / (64 * 512) == file_bits
    assert packed.numel() * 8 / (64 * 512) == resident_bits


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_symmetric_types_with_stored_offsets_run_the_same_weights(turbo_ops, block_isa, name):
    """Q8_0 and Q4_0 packed with their offsets (to join parts of Q5_0 or Q4_1: c * sx added
    in floats) and without (the zero point taken off the integer sums) run the same
    weights; the integer zero point is the closer to the exact product of the rounded
    activations, where the float offset cancels most of its block's sum."""
    raw, weights = random_blocks(name, 37, 224, seed=8)
    implied = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type(name))
    stored = turbo_ops.pack_gguf_weight(torch.from_numpy(raw), ggml_type(name), 1, True)
    assert stored.shape[2] > implied.shape[2]
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((9, 224)).astype(np.float32))
    exact = rounded_activations(x.numpy()) @ weights.T
    errors = []
    for packed in (implied, stored):
        out = torch.full((9, 37), float("nan"))
        turbo_ops.linear(out, x, packed, None, None)
        check(out, x.numpy(), weights)
        errors.append(np.abs(out.double().numpy() - exact).max())
    assert errors[0] < errors[1], errors  # equal only if both added the offset alike


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_1", "Q4_1", "Q4_0")])
def test_fused_parts_of_types_that_pack_alike(turbo_ops, types):
    """A q/k/v of Q5_0, Q5_0 and Q8_0 (llama.cpp's Q4_K_M does that) runs as blocks, joined
    panel by panel (Q8_0, or Q4_0 beside Q4_1, then keeps its offsets); parts that would
    leave a panel half full fall back to a float matrix."""
    from llmctl_turbo.gguf_weights import BlockPacker

    from llmctl.model.gguf import GGUFBlocks

    def parts(rows):
        made = [random_blocks(t, n, 96, seed=n) for t, n in zip(types, rows)]
        blocks = [
            GGUFBlocks(torch.from_numpy(raw), t, (n, 96))
            for (raw, _), t, n in zip(made, types, rows)
        ]
        return blocks, np.concatenate([w for _, w in made])

    x = np.random.default_rng(3).standard_normal((5, 96)).astype(np.float32)
    for rows, kind in (((64, 32, 32), "+".join(types)), ((40, 32, 32), "dequantized to float32")):
        blocks, weights = parts(rows)
        packer = BlockPacker(torch.float32)
        packed = packer.pack(blocks)
        assert dict(packer.kinds) == {kind: 1}
        out = torch.full((5, sum(rows)), float("nan"))
        turbo_ops.linear(out, torch.from_numpy(x), packed, None, None)
        if kind.startswith(types[0]):
            check(out, x, weights)
        else:  # float weights: no activation rounding
            ref = x.astype(np.float64) @ weights.T
            assert np.abs(out.double().numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
