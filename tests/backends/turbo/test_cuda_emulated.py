"""turbo's CUDA kernels, run on the CPU by the test emulator, against plain torch and
turbo's CPU ops.

The .cu sources are compiled as C++ for ``cuda_emulator/`` (fibers for threads; warp
shuffles, ldmatrix, mma.sync and cp.async emulated from the PTX ISA's definitions) and
called through their C ABI on CPU tensors, so the kernels' indexing, masking, split-K
bookkeeping and tensor-core fragment handling are checked on a machine without a GPU.
Speed, and races only real concurrency shows, are for test_cuda_kernels.py and
``scripts/gpu_check.py`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from llmctl.engine.quant import dequantize_kv, quantize_kv
from tests.backends.turbo.kernel_checks import (
    CUDA_BLOCK_SIZES,
    DTYPES,
    GQA_SHAPES,
    TOLERANCE,
    check_decode,
    check_prefill,
    check_rotary_and_write_kv,
    decode_contexts,
)
from tests.helpers.kernel_refs import (
    PagedCache,
    check_int8_write,
    int8_cache,
    int32,
    poisoned,
    quantized,
    ref_paged_attention,
    ref_rms_norm,
    ref_rotary,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def block_size_and_dtype(variants, name=lambda v: str(v).removeprefix("torch.")):
    """Every (block size, variant) pair; by default only a diagonal that still covers each
    block size and each variant (an emulated kernel runs ~1000x slower than on a GPU,
    where test_cuda_kernels.py runs every pair); the rest are ``slow``."""
    return [
        pytest.param(
            block_size, variant, id=f"{block_size}-{name(variant)}",
            marks=() if i % len(variants) == j else pytest.mark.slow,
        )
        for i, block_size in enumerate(CUDA_BLOCK_SIZES)
        for j, variant in enumerate(variants)
    ]  # fmt: skip


# The decode kernels: SIMT (every dtype) and tensor cores (bf16 / fp16).
DECODE_KERNELS = [(dtype, False) for dtype in DTYPES] + [
    (torch.bfloat16, True),
    (torch.float16, True),
]


def decode_kernel_id(kernel) -> str:
    dtype, tensor_cores = kernel
    return f"{str(dtype).removeprefix('torch.')}-{'mma' if tensor_cores else 'simt'}"


@pytest.mark.parametrize(
    "block_size, kernel", block_size_and_dtype(DECODE_KERNELS, decode_kernel_id)
)
def test_decode_attention(emulated, turbo_ops, block_size, kernel):
    dtype, tensor_cores = kernel

    def run(*args):
        return emulated.paged_decode_attention(*args, tensor_cores=tensor_cores)

    for heads, kv_heads, head_dim in GQA_SHAPES:
        check_decode(
            run, turbo_ops, block_size, dtype, heads, kv_heads, head_dim,
            decode_contexts(block_size), seed=block_size,
        )  # fmt: skip


@pytest.mark.parametrize("kernel", DECODE_KERNELS, ids=decode_kernel_id)
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_decode_split_k_combines_partial_softmaxes(emulated, turbo_ops, kernel, num_splits):
    """Forced split counts: sequences that use every split, some, or one (which then
    writes its output directly)."""
    dtype, tensor_cores = kernel

    def run(*args):
        return emulated.paged_decode_attention(
            *args, num_splits=num_splits, tensor_cores=tensor_cores
        )

    used = check_decode(run, turbo_ops, 64, dtype, 8, 2, 128, [900, 300, 129, 5], seed=num_splits)
    assert used == num_splits


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["simt", "mma"])
def test_decode_large_groups_and_head_dims(emulated, turbo_ops, tensor_cores):
    """A group of 12 heads takes two blocks per KV head; head_dim 256 and 96."""

    def run(*args):
        return emulated.paged_decode_attention(*args, num_splits=3, tensor_cores=tensor_cores)

    for heads, kv_heads, head_dim in [(24, 2, 256), (12, 1, 96), (6, 3, 256)]:
        check_decode(run, turbo_ops, 32, torch.bfloat16, heads, kv_heads, head_dim, [300, 45])


@pytest.mark.parametrize("head_dim", [64, 12], ids=["split_k", "simt"])
def test_decode_padding_rows_of_cuda_graphs_output_zero(emulated, head_dim):
    """A CUDA-graph batch pads with sequences of context length 0: their output is 0."""
    context_lens = [5, 0, 40, 0]
    cache = PagedCache(32, [5, 1, 40, 1], 2, head_dim, torch.float32)
    q = torch.randn(4, 4, head_dim)
    out = poisoned(*q.shape)
    tables, lens = cache.padded_tables(), int32(context_lens)
    if head_dim % 8 == 0:
        emulated.paged_decode_attention(out, q, cache.k, cache.v, tables, lens, 0.1, num_splits=2)
    else:
        query_start_loc = int32([0, 1, 2, 3, 4])
        emulated.paged_prefill_attention(
            out, q, cache.k, cache.v, tables, query_start_loc, lens, 0.1, tensor_cores=False
        )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    real = [0, 2]
    expected = ref_paged_attention(
        q[real], cache.k, cache.v, [cache.tables[i] for i in real], [1, 1], [5, 40], 0.1
    )
    torch.testing.assert_close(out[real], expected, **TOLERANCE[torch.float32])


def test_fast_division_by_block_size_is_exact(emulated):
    """The kernels divide token indices by the block size with a multiply and a shift."""
    for divisor in [*range(1, 300), 384, 512, 1000, 1024, 4096, 65537, (1 << 31) - 1]:
        assert emulated.fast_divmod_mismatches(divisor) == 0, divisor


def test_decode_split_plan_fills_the_gpu_and_fits_shared_memory(emulated):
    # A lone sequence is cut into many splits; a big batch of short contexts into none...
    assert emulated.decode_num_splits(1, 32, 8, 4096) >= 16
    assert emulated.decode_num_splits(256, 32, 8, 128) == 1
    # ...but a long context always gets enough splits for its scores to fit.
    assert emulated.decode_num_splits(256, 32, 8, 32768) > 1
    # Splits never go below the minimum length (128 tokens).
    assert emulated.decode_num_splits(1, 32, 8, 256) == 2


def test_decode_context_beyond_the_table_traps(emulated, turbo_ops):
    """The split plan assumes contexts fit the block table; a longer one stops the kernel
    (a launch failure) instead of silently dropping tokens."""

    def run(out, q, k_cache, v_cache, tables, lens, scale):
        emulated.paged_decode_attention(out, q, k_cache, v_cache, tables[:, :2], lens, scale, 1)

    with pytest.raises(RuntimeError, match="__trap"):
        check_decode(run, turbo_ops, 32, torch.float32, 4, 2, 32, [200, 40])


@pytest.mark.parametrize("block_size, dtype", block_size_and_dtype([torch.bfloat16, torch.float16]))
def test_prefill_attention_on_tensor_cores(emulated, turbo_ops, block_size, dtype):
    for heads, kv_heads, head_dim in GQA_SHAPES:
        check_prefill(
            emulated.paged_prefill_attention, turbo_ops, block_size, dtype, heads, kv_heads,
            head_dim, seed=block_size,
        )  # fmt: skip


def test_prefill_attention_head_dim_256_on_tensor_cores(emulated, turbo_ops):
    check_prefill(emulated.paged_prefill_attention, turbo_ops, 64, torch.bfloat16, 8, 2, 256)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_attention_simt(emulated, turbo_ops, dtype):
    """The SIMT kernel: turbo's fp32 prefill and the path for odd head_dims."""

    def run(*args):
        emulated.paged_prefill_attention(*args, tensor_cores=False)

    check_prefill(run, turbo_ops, 32, dtype, 8, 2, 40)
    check_prefill(run, turbo_ops, 96, dtype, 6, 6, 12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding_fused_with_kv_write(emulated, turbo_ops, dtype):
    check_rotary_and_write_kv(emulated.rotary_write_kv, turbo_ops, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [256, 200, 172], ids=lambda d: f"dim{d}")
def test_row_ops_vectorised_and_scalar(emulated, dtype, dim):
    """RMSNorm (with and without the residual add) and SiLU-and-mul, on widths that take
    the 16-byte path and widths that do not."""
    generator = torch.Generator().manual_seed(dim)
    x = (3 * torch.randn(9, dim, generator=generator)).to(dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=generator)).to(dtype)
    residual = torch.randn(9, dim, generator=generator).to(dtype)
    out = poisoned(9, dim, dtype=dtype)
    emulated.rms_norm(out, x, weight, 1e-6)
    torch.testing.assert_close(out, ref_rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])
    summed = residual + x
    emulated.rms_norm(out, x, weight, 1e-6, residual=residual)
    torch.testing.assert_close(residual, summed, **TOLERANCE[dtype])
    torch.testing.assert_close(out, ref_rms_norm(summed, weight, 1e-6), **TOLERANCE[dtype])

    gate_up = (2 * torch.randn(9, 2 * dim, generator=generator)).to(dtype)
    out = poisoned(9, dim, dtype=dtype)
    emulated.silu_and_mul(out, gate_up)
    expected = F.silu(gate_up[:, :dim].float()) * gate_up[:, dim:].float()
    torch.testing.assert_close(out, expected.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_linear_against_dequantized_matmul(emulated, dtype):
    """The int8-weight decode kernel against plain torch on the dequantized weight, for
    1..20 rows (tiles of 8, partial tiles), feature counts that leave partial warp tiles,
    K that takes 16-byte runs and K that does not (odd, or a strided x), with and
    without a bias. fp32 accumulation in both; the tolerance is the activation dtype's
    (one rounding of the output, plus summation order)."""
    from llmctl.engine.quant import quantize_weight_int8

    generator = torch.Generator().manual_seed(16)
    shapes = [(1, 7, 64), (3, 33, 48), (8, 16, 32), (9, 10, 37), (16, 24, 96), (20, 5, 17)]
    for rows, features, in_features in shapes:
        weight, scale = quantize_weight_int8(
            torch.randn(features, in_features, generator=generator)
        )
        bias = torch.randn(features, generator=generator).to(dtype)
        # x with spare columns: a strided view, as turbo's fused qkv rows are; the one 3
        # columns in is not 16-byte aligned, so it takes the element-wise path.
        padded = torch.randn(rows, in_features + 8, generator=generator).to(dtype)
        for x in (padded[:, :in_features].contiguous(), padded[:, 3 : 3 + in_features]):
            for b in (None, bias):
                out = poisoned(rows, features, dtype=dtype)
                vectorized = emulated.int8_linear(out, x, weight, scale, b)
                assert vectorized == (in_features % 16 == 0 and x.data_ptr() % 16 == 0)
                expected = x.float() @ (weight.float() * scale[:, None]).T
                if b is not None:
                    expected += b.float()
                torch.testing.assert_close(out, expected.to(dtype), **TOLERANCE[dtype])


# ------------------------------------------------------------------ GGUF blocks
# quantization=gguf on CUDA: the decode GEMV over a GGUF file's blocks as stored, and the
# dequantization prompts take, against gguf.quants' dequantization (float64 product).

# (rows, features, in_features): 1-8 rows (one partial tile of 8), 9 and 20 (several);
# odd feature counts (partial tiles of 2); K from less than a warp's chunks to more than
# the thread block's 128 (a partial second pass: Q8_0 / Q4 take 8 weights a chunk, so
# 1056 is 132 chunks), never a multiple of the block's step.
GGUF_LEGACY_SHAPES = [
    (1, 7, 96), (2, 13, 32), (3, 33, 160), (5, 9, 1056), (8, 16, 64), (9, 3, 352), (20, 5, 2080)
]  # fmt: skip
# K-quants: blocks of 256, 32 chunks each (Q6_K: 16), so 2304 is 288 (144) chunks.
GGUF_K_SHAPES = [(1, 7, 256), (4, 13, 768), (8, 5, 2304), (20, 3, 512)]


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gguf_linear_against_dequantized_matmul(emulated, name, dtype):
    """Every block type and activation dtype against float64 x @ dequantize(w)^T on fresh
    random blocks; x contiguous (4-element loads) and a strided view 3 columns in (the
    element-wise path), with and without a bias."""
    from tests.helpers.gguf_blocks import magnitude_tolerance, random_gguf_rows, reference_linear

    ggml_type = GGMLQuantizationType[name].value
    shapes = GGUF_K_SHAPES if name.endswith("_K") else GGUF_LEGACY_SHAPES
    generator = torch.Generator().manual_seed(ggml_type)
    for i, (rows, features, in_features) in enumerate(shapes):
        weight = random_gguf_rows(name, features, in_features, seed=100 * ggml_type + i)
        bias = torch.randn(features, generator=generator).to(dtype)
        padded = torch.randn(rows, in_features + 8, generator=generator).to(dtype)
        for x in (padded[:, :in_features].contiguous(), padded[:, 3 : 3 + in_features]):
            for b in (None, bias) if i % 2 else (None,):
                out = poisoned(rows, features, dtype=dtype)
                vectorized = emulated.gguf_linear(out, x, weight, ggml_type, b)
                assert vectorized == (x.data_ptr() % (4 * x.element_size()) == 0)
                expected = reference_linear(x, weight, name, b)
                torch.testing.assert_close(
                    out.double(),
                    expected.to(dtype).double(),
                    **magnitude_tolerance(TOLERANCE[dtype], expected),
                )


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_dequantize_is_gguf_quants(emulated, name):
    """The prompt path's dequantization holds gguf.quants' fp32 values (rounded once to
    bf16 in bf16)."""
    from tests.helpers.gguf_blocks import dequantized, random_gguf_rows

    ggml_type = GGMLQuantizationType[name].value
    in_features = 512 if name.endswith("_K") else 96
    weight = random_gguf_rows(name, 5, in_features, seed=ggml_type)
    want = dequantized(weight, name)
    for dtype in (torch.float32, torch.bfloat16):
        out = poisoned(5, in_features, dtype=dtype)
        emulated.gguf_dequantize(out, weight, ggml_type)
        torch.testing.assert_close(out, want.to(dtype), rtol=1e-6, atol=1e-7)


def test_gguf_linear_refuses_what_it_cannot_read(emulated):
    """An unknown type, and K not a whole number of blocks, are errors, not wrong sums."""
    weight = torch.zeros(4, 34, dtype=torch.uint8)
    x, out = torch.randn(1, 32), torch.empty(1, 4)
    with pytest.raises(RuntimeError, match="cudaError"):
        emulated.gguf_linear(out, x, weight, GGMLQuantizationType.Q5_0.value)
    with pytest.raises(RuntimeError, match="cudaError"):
        emulated.gguf_linear(out, torch.randn(1, 48), weight, GGMLQuantizationType.Q8_0.value)


# ------------------------------------------------------------------ int8 KV cache
# kv_cache_dtype=int8 on CUDA: the write kernels hold exactly quantize_kv's bytes and
# scales; the SIMT attention kernel (the one that reads an int8 cache) matches plain
# torch over the cache dequantized in float32.

INT8_KV_CASES = [(16, torch.float32), (32, torch.bfloat16)]


@pytest.mark.parametrize("block_size, dtype", INT8_KV_CASES, ids=str)
def test_write_kv_cache_int8_holds_quantize_kv_bytes(emulated, block_size, dtype):
    # 3 KV heads of 40: rows that are not whole warps, more rows than the block's warps.
    check_int8_write(emulated.write_kv_cache, dtype, 3, 40, block_size, 5, 23, seed=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_write_kv_int8_quantizes_the_rotated_key(emulated, dtype):
    from llmctl_turbo.rope import cos_sin_cache

    from llmctl.engine.rope import rope_inv_freq

    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, tokens, block_size = 6, 2, 48, 13, 16
    frequencies = rope_inv_freq(head_dim, 10000.0, None)
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(tokens, sum(widths), generator=generator).to(dtype)
    q, k, v = (part.view(tokens, -1, head_dim) for part in qkv.split(widths, dim=1))
    original_k = k.clone()
    positions = torch.randint(0, 256, (tokens,), generator=generator, dtype=torch.int32)
    slots = torch.randperm(2 * block_size, generator=generator)[:tokens].to(torch.int32)
    k_cache, k_scale = int8_cache(2, block_size, kv_heads, head_dim)
    v_cache, v_scale = int8_cache(2, block_size, kv_heads, head_dim)

    emulated.rotary_write_kv(
        positions, q, k, v, cos_sin_cache(frequencies, 256), k_cache, v_cache, slots,
        k_scale, v_scale,
    )  # fmt: skip

    written = slots.long()
    got_k = dequantize_kv(
        k_cache.view(-1, kv_heads, head_dim)[written],
        k_scale.view(-1, kv_heads)[written],
        torch.float32,
    )
    # The key is rotated in float32 and rounded to the dtype before it is quantized: one
    # step of its row's scale from the exact rotation at most (plus the dtype's rounding).
    expected_k = ref_rotary(original_k, positions, frequencies)
    step = k_scale.view(-1, kv_heads)[written][..., None]
    slack = 0 if dtype == torch.float32 else expected_k.abs() * 2**-8
    assert ((got_k - expected_k).abs() <= step * 1.01 + slack).all()
    q_v, s_v = quantize_kv(v, torch.int8)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[written], q_v)
    assert torch.equal(v_scale.view(-1, kv_heads)[written], s_v)


def int8_attention_case(block_size, dtype, query_lens, context_lens, seed):
    """A GQA batch over a random cache quantized to int8: (q, tables, query_start_loc,
    lens, (k, v, k_scale, v_scale), expected output over the dequantized cache)."""
    heads, kv_heads, head_dim = 6, 2, 40
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, torch.float32, seed=seed)
    int8_kv, (k_ref, v_ref) = quantized(cache)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    expected = ref_paged_attention(q, k_ref, v_ref, cache.tables, query_lens, context_lens, scale)
    query_start_loc = int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    return q, cache.padded_tables(), query_start_loc, int32(context_lens), int8_kv, expected


@pytest.mark.parametrize("block_size, dtype", INT8_KV_CASES, ids=str)
@pytest.mark.parametrize("batch", ["decode", "prefill"])
def test_simt_attention_over_int8_cache(emulated, block_size, dtype, batch):
    if batch == "decode":
        context_lens = [1, block_size - 1, block_size + 1, 2 * block_size + 3, 37]
        query_lens = [1] * len(context_lens)
    else:  # fresh prompts, chunks after cached context, decodes, one over a kThreads tile
        query_lens = [5, 1, block_size + 3, 9, 131]
        context_lens = [5, 2 * block_size + 1, block_size + 3, block_size + 21, 133]
    q, tables, query_start_loc, lens, (k, v, k_scale, v_scale), expected = int8_attention_case(
        block_size, dtype, query_lens, context_lens, seed=block_size
    )
    out = poisoned(*q.shape, dtype=dtype)
    emulated.paged_prefill_attention(
        out, q, k, v, tables, query_start_loc, lens, q.shape[2] ** -0.5,
        tensor_cores=False, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
