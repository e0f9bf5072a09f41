"""turbo's CPU ops over an int8 KV cache (kv_cache_dtype=int8) against plain torch.

Writing must hold exactly the bytes the torch backend holds: ``llmctl.engine.quant``'s
``quantize_kv`` (int8 values and float32 scales compared bit for bit). Attention must be
the plain-torch attention over the cache dequantized first; the kernels fold each row's
scale into its score and its softmax weight instead, which reorders a few float32
roundings: 1e-5 for float32 queries (the float cache's tolerance), bf16's for bfloat16.
Each instruction set the CPU has runs every case (the ``isa`` fixture).
"""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.quant import dequantize_kv, quantize_kv
from tests.helpers.kernel_refs import (
    TOLERANCE,
    PagedCache,
    check_int8_write,
    int8_cache,
    int32,
    poisoned,
    quantized,
    ref_paged_attention,
    ref_rotary,
)

BLOCK_SIZES = [16, 32, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("tokens", [50, 3000])  # 3000: a prompt's write, in several chunks
def test_write_kv_cache_int8_holds_quantize_kv_bytes(turbo_ops, isa, dtype, head_dim, tokens):
    num_blocks = tokens // 16 + 7
    check_int8_write(
        turbo_ops.write_kv_cache, dtype, 2, head_dim, 16, num_blocks, tokens, seed=head_dim
    )


def test_rotary_embedding_and_write_kv_quantizes_the_rotated_key(turbo_ops):
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, tokens, block_size = 4, 2, 16, 9, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 100, (tokens,), generator=generator, dtype=torch.int32)
    frequencies = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(128).float()[:, None] * frequencies[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    expected_k = ref_rotary(k, positions, frequencies)
    k_cache, k_scale = int8_cache(2, block_size, kv_heads, head_dim)
    v_cache, v_scale = int8_cache(2, block_size, kv_heads, head_dim)
    slots = torch.arange(tokens, dtype=torch.int32) + 5
    turbo_ops.rotary_embedding_and_write_kv(
        positions, q, k, v, cos_sin, k_cache, v_cache, slots, k_scale, v_scale
    )
    written = slots.long()
    got_k = dequantize_kv(
        k_cache.view(-1, kv_heads, head_dim)[written],
        k_scale.view(-1, kv_heads)[written],
        torch.float32,
    )
    # The kernel's rotation differs from the reference's by float32 rounding, which can
    # move a value across a rounding boundary: one step of its row's scale at most.
    step = k_scale.view(-1, kv_heads)[written][..., None]
    assert ((got_k - expected_k).abs() <= step * 1.01).all()
    q_v, s_v = quantize_kv(v, torch.int8)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[written], q_v)
    assert torch.equal(v_scale.view(-1, kv_heads)[written], s_v)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 12, 64])
def test_paged_decode_attention_over_int8_cache(turbo_ops, isa, block_size, dtype, head_dim):
    heads, kv_heads = 6, 2  # GQA
    context_lens = [1, block_size - 1, block_size + 1, 3 * block_size - 5, 37]
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, torch.float32, seed=head_dim)
    (k, v, k_scale, v_scale), (k_ref, v_ref) = quantized(cache)
    q = torch.randn(len(context_lens), heads, head_dim).to(dtype)
    out = poisoned(*q.shape, dtype=dtype)
    scale = head_dim**-0.5
    turbo_ops.paged_decode_attention(
        out, q, k, v, cache.padded_tables(), int32(context_lens), scale, k_scale, v_scale
    )
    expected = ref_paged_attention(
        q, k_ref, v_ref, cache.tables, [1] * len(context_lens), context_lens, scale
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", [8, 64])
def test_paged_prefill_attention_over_int8_cache(turbo_ops, isa, block_size, head_dim):
    """Fresh prompts, prompt chunks after cached tokens and decodes in one batch."""
    torch.manual_seed(block_size)
    heads, kv_heads = 8, 2
    query_lens = [5, 1, block_size + 3, 17, 1]
    context_lens = [5, 2 * block_size + 1, block_size + 3, block_size + 21, 9]
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, torch.float32, seed=7)
    (k, v, k_scale, v_scale), (k_ref, v_ref) = quantized(cache)
    q = torch.randn(sum(query_lens), heads, head_dim)
    query_start_loc = int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    out = poisoned(*q.shape)
    turbo_ops.paged_prefill_attention(
        out,
        q,
        k,
        v,
        cache.padded_tables(),
        query_start_loc,
        int32(context_lens),
        0.3,
        k_scale,
        v_scale,
    )
    expected = ref_paged_attention(q, k_ref, v_ref, cache.tables, query_lens, context_lens, 0.3)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_int8_cache_errors_name_the_scales(turbo_ops):
    key = torch.randn(3, 2, 8)
    slots = int32([0, 1, 2])
    k_cache, k_scale = int8_cache(2, 16, 2, 8)
    v_cache, v_scale = int8_cache(2, 16, 2, 8)
    with pytest.raises(RuntimeError, match="k_cache is int8, so its scales must be"):
        turbo_ops.write_kv_cache(key, key, k_cache, v_cache, slots)
    with pytest.raises(
        RuntimeError, match=r"v_cache is int8, so its scales must be .*\[2, 16, 2\]"
    ):
        turbo_ops.write_kv_cache(key, key, k_cache, v_cache, slots, k_scale, v_scale[:1])
    float_cache = torch.randn(2, 16, 2, 8)
    with pytest.raises(RuntimeError, match="scales go with an int8 cache only"):
        turbo_ops.write_kv_cache(key, key, float_cache, float_cache, slots, k_scale, v_scale)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        turbo_ops.write_kv_cache(key, key, k_cache, float_cache, slots, k_scale)
