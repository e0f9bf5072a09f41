"""turbo's CUDA ops on a GPU against plain torch and turbo's CPU ops (marked ``gpu``:
skipped, with the reason, where there is no CUDA device or no CUDA build of turbo).

The same cases as test_cuda_emulated.py (kernel_checks.py), through the real ops: the
binding picks the split-K decode kernel for one-token-per-sequence batches, the
tensor-core kernel for bf16 / fp16 prefill and the SIMT kernel for fp32 prefill.
Also the native step on the GPU against transformers' logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
from tests.helpers.kernel_refs import poisoned, ref_rms_norm
from tests.helpers.turbo_step import check_against_transformers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


@pytest.fixture(scope="module")
def cuda_ops(turbo_ops):
    from llmctl_turbo.build import build_spec

    if not build_spec().with_cuda:
        pytest.skip("turbo was built without CUDA kernels (no nvcc, or a CPU-only torch)")
    return turbo_ops


def on_device(op):
    """``op`` run on CUDA copies of its CPU tensor arguments, written back in place."""

    def run(*args):
        moved = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        result = op(*moved)
        torch.cuda.synchronize()
        for original, copy in zip(args, moved, strict=True):
            if isinstance(original, torch.Tensor):
                original.copy_(copy.cpu())
        return result

    return run


@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention(cuda_ops, block_size, dtype):
    run = on_device(cuda_ops.paged_decode_attention)
    for heads, kv_heads, head_dim in GQA_SHAPES:
        check_decode(
            run, cuda_ops, block_size, dtype, heads, kv_heads, head_dim,
            decode_contexts(block_size), seed=block_size,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_splits_long_contexts(cuda_ops, dtype):
    """Three sequences, long contexts: the split plan cuts them into many splits (a lone
    sequence of 3000 tokens fills the GPU only that way), and head_dims 256 and 96, and
    a group of 12 heads (two blocks per KV head)."""
    run = on_device(cuda_ops.paged_decode_attention)
    contexts = [3000, 700, 65]
    for heads, kv_heads, head_dim in [(32, 8, 128), (24, 2, 256), (12, 1, 96)]:
        check_decode(run, cuda_ops, 64, dtype, heads, kv_heads, head_dim, contexts, seed=heads)


@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_attention(cuda_ops, block_size, dtype):
    run = on_device(cuda_ops.paged_prefill_attention)
    for heads, kv_heads, head_dim in GQA_SHAPES:
        check_prefill(run, cuda_ops, block_size, dtype, heads, kv_heads, head_dim, seed=block_size)


def test_prefill_attention_head_dim_256_and_odd_head_dims(cuda_ops):
    run = on_device(cuda_ops.paged_prefill_attention)
    check_prefill(run, cuda_ops, 64, torch.bfloat16, 8, 2, 256)
    check_prefill(run, cuda_ops, 32, torch.bfloat16, 8, 2, 40)  # SIMT: not a multiple of 8...
    check_prefill(run, cuda_ops, 32, torch.bfloat16, 6, 6, 12)
    decode = on_device(cuda_ops.paged_decode_attention)
    check_decode(decode, cuda_ops, 32, torch.float16, 6, 3, 12, [40, 7])  # ...in decode too


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding_fused_with_kv_write(cuda_ops, dtype):
    check_rotary_and_write_kv(on_device(cuda_ops.rotary_embedding_and_write_kv), cuda_ops, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [2048, 200, 172], ids=lambda d: f"dim{d}")
def test_row_ops_vectorised_and_scalar(cuda_ops, dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    x = (3 * torch.randn(9, dim, generator=generator)).to(dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=generator)).to(dtype)
    residual = torch.randn(9, dim, generator=generator).to(dtype)
    out = poisoned(9, dim, dtype=dtype)
    on_device(cuda_ops.rms_norm)(out, x, weight, 1e-6)
    torch.testing.assert_close(out, ref_rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])
    summed = residual + x
    on_device(cuda_ops.add_rms_norm)(out, residual, x, weight, 1e-6)
    torch.testing.assert_close(residual, summed, **TOLERANCE[dtype])
    torch.testing.assert_close(out, ref_rms_norm(summed, weight, 1e-6), **TOLERANCE[dtype])

    gate_up = (2 * torch.randn(9, 2 * dim, generator=generator)).to(dtype)
    out = poisoned(9, dim, dtype=dtype)
    on_device(cuda_ops.silu_and_mul)(out, gate_up)
    expected = F.silu(gate_up[:, :dim].float()) * gate_up[:, dim:].float()
    torch.testing.assert_close(out, expected.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gguf_linear_against_dequantized_matmul(cuda_ops, name, dtype):
    """turbo's linear op over GGUF rows on CUDA: the decode GEMV (1-20 rows, x contiguous
    and strided) and, from 33 rows, the dequantize + cuBLAS path, against float64
    x @ dequantize(w)^T on fresh random blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from tests.helpers.gguf_blocks import magnitude_tolerance, random_gguf_rows, reference_linear

    kind = GGMLQuantizationType[name]
    block_bytes = GGML_QUANT_SIZES[kind][1]
    shapes = [(1, 7, 768), (8, 4099, 1024), (20, 33, 256), (40, 300, 512)]
    generator = torch.Generator().manual_seed(kind.value)
    for i, (rows, features, in_features) in enumerate(shapes):
        weight = random_gguf_rows(name, features, in_features, seed=kind.value * 10 + i)
        bias = torch.randn(features, generator=generator).to(dtype)
        padded = torch.randn(rows, in_features + 8, generator=generator).to(dtype)
        for x in (padded[:, :in_features].contiguous(), padded[:, 3 : 3 + in_features]):
            for b in (bias, torch.empty(0, dtype=dtype)):
                out = poisoned(rows, features, dtype=dtype)
                blocks = weight.view(features, -1, block_bytes)
                on_device(cuda_ops.linear)(out, x, blocks, b, None)
                expected = reference_linear(x, weight, name, b if b.numel() else None)
                torch.testing.assert_close(
                    out.double(),
                    expected.to(dtype).double(),
                    **magnitude_tolerance(TOLERANCE[dtype], expected),
                )


@pytest.mark.parametrize("block_size", [32, 96])
def test_native_step_on_gpu_matches_transformers(cuda_ops, stories_dir, block_size):
    check_against_transformers(stories_dir, block_size, device="cuda")


def test_native_step_on_gpu_qwen2_with_biases(cuda_ops, tiny_model_dir):
    check_against_transformers(tiny_model_dir("qwen2"), block_size=32, device="cuda")


# ------------------------------------------------------------------ LoRA (csrc/cuda/lora.cu)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lora_add_slots_matches_plain_torch(cuda_ops, dtype):
    """The cases of test_cuda_lora_emulated.py through the real op: rows 1-20 and 64,
    ranks 2 / 8 / 16, fused parts, strided x and out, base rows left bit for bit."""
    from tests.backends.turbo.kernel_checks import LORA_PARTS, LORA_ROWS, check_lora_add

    lora_add = on_device(cuda_ops.lora_add_slots)
    for rank, in_features in [(2, 67), (8, 200), (16, 33)]:
        for parts in LORA_PARTS:
            for rows in LORA_ROWS:
                check_lora_add(lora_add, dtype, rows, rank, parts, in_features, rows * rank)


def test_lora_add_slots_replays_in_a_cuda_graph(cuda_ops):
    """Captured once, replayed with other slots written into the same device tensor: the
    pass reads them on the device, so each replay follows the new slots."""
    from tests.helpers.kernel_refs import ref_lora_add

    generator = torch.Generator().manual_seed(5)
    rows, rank, in_features, width = 16, 8, 96, 72
    a = (torch.randn(4, rank, in_features, generator=generator) / 4).cuda()
    bt = (torch.randn(4, rank, width, generator=generator) / 4).cuda()
    x = torch.randn(rows, in_features, generator=generator).cuda()
    base = torch.randn(rows, width, generator=generator).cuda()
    out, slots = base.clone(), torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    cuda_ops.lora_add_slots(out, x, a, bt, [0], [width], slots)  # warm up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ops.lora_add_slots(out, x, a, bt, [0], [width], slots)
    for step in range(3):
        new = torch.randint(-1, 4, (rows,), generator=generator, dtype=torch.int32)
        slots.copy_(new)
        out.copy_(base)
        graph.replay()
        want = ref_lora_add(base.cpu(), x.cpu(), a.cpu(), bt.cpu(), [0], [width], new)
        torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4, msg=str(step))
