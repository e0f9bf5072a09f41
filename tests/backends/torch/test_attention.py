"""The plain-torch paged attention against a naive dense reference on random inputs."""

from __future__ import annotations

import pytest
import torch
from llmctl_torch import attention
from llmctl_torch.attention import (
    attention_ops,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

from llmctl.engine.quant import dequantize_kv, quantize_kv
from llmctl.errors import OptionError


def dense_reference(q, keys, values, scale):
    """Causal attention of ``q: [Q, Hq, D]``, the last Q positions of ``keys: [L, Hkv, D]``,
    written the obvious way: one head and one query at a time."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(q_len):
        visible = ctx_len - q_len + i + 1
        for h in range(num_heads):
            k = keys[:visible, h // group].double()
            v = values[:visible, h // group].double()
            weights = torch.softmax((k @ q[i, h].double()) * scale, dim=0)
            out[i, h] = (weights @ v).to(q.dtype)
    return out


def scatter_into_cache(seqs_kv, block_size, num_blocks, generator):
    """Write each sequence's dense ``(keys, values)`` into shuffled cache blocks with
    ``write_kv``; return the caches and padded block tables."""
    _, num_kv_heads, head_dim = seqs_kv[0][0].shape
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn_like(k_cache)  # garbage outside the written slots
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for keys, values in seqs_kv:
        table = [free.pop() for _ in range(-(-keys.shape[0] // block_size))]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(keys.shape[0])]
        )
        write_kv(keys, values, k_cache, v_cache, slots)
        tables.append(table)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, padded


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_decode_and_prefill_match_dense_reference(block_size, num_heads, num_kv_heads):
    generator = torch.Generator().manual_seed(block_size * 10 + num_kv_heads)
    head_dim, scale = 16, 0.3
    # Ragged contexts: length 1, exactly one block, one past a boundary, one short, long.
    context_lens = [1, block_size, block_size + 1, 2 * block_size - 1, 3 * block_size + 5]
    # Query counts per sequence: a mix of whole-prompt prefill, chunks and single tokens.
    query_lens = [1, block_size, 1, 7, 2 * block_size + 3]
    seqs_kv = [
        (
            torch.randn(n, num_kv_heads, head_dim, generator=generator),
            torch.randn(n, num_kv_heads, head_dim, generator=generator),
        )
        for n in context_lens
    ]
    k_cache, v_cache, tables = scatter_into_cache(seqs_kv, block_size, 32, generator)
    lens = torch.tensor(context_lens, dtype=torch.int32)

    q_decode = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
    got = paged_decode_attention(q_decode, k_cache, v_cache, tables, lens, scale)
    for b, (keys, values) in enumerate(seqs_kv):
        want = dense_reference(q_decode[b : b + 1], keys, values, scale)
        torch.testing.assert_close(got[b : b + 1], want, atol=1e-5, rtol=1e-5)

    q_prefill = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    got = paged_prefill_attention(q_prefill, k_cache, v_cache, tables, starts, lens, scale)
    for b, (keys, values) in enumerate(seqs_kv):
        rows = slice(starts[b], starts[b + 1])
        want = dense_reference(q_prefill[rows], keys, values, scale)
        torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_a_quantized_cache_attends_like_the_reference_on_dequantized_kv(kv_dtype):
    """write_kv quantizes with ``quantize_kv`` (the stored codes and scales are exactly
    its); decode and prefill then match the dense reference run on the dequantized K/V
    to float32 rounding. fp8 runs here in plain torch; the engine allows it on GPUs only."""
    generator = torch.Generator().manual_seed(5)
    block_size, num_heads, num_kv_heads, head_dim, scale = 16, 8, 2, 16, 0.3
    context_lens, query_lens = [1, 16, 17, 40], [1, 16, 1, 9]
    seqs_kv = [
        (
            torch.randn(n, num_kv_heads, head_dim, generator=generator) * 3,
            torch.randn(n, num_kv_heads, head_dim, generator=generator),
        )
        for n in context_lens
    ]
    num_blocks = 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Garbage outside the written slots: random codes, finite scales (see the module doc).
    k_cache = torch.randint(-100, 100, shape, generator=generator).float().to(kv_dtype)
    v_cache = torch.randint(-100, 100, shape, generator=generator).float().to(kv_dtype)
    scales = torch.rand((2, *shape[:3]), generator=generator)
    kv_scales = (scales[0], scales[1])
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for keys, values in seqs_kv:
        table = [free.pop() for _ in range(-(-keys.shape[0] // block_size))]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(keys.shape[0])])  # fmt: skip
        write_kv(keys, values, k_cache, v_cache, slots, kv_scales=kv_scales)
        codes, row_scales = quantize_kv(keys, kv_dtype)
        stored = k_cache.view(-1, num_kv_heads, head_dim)[slots]
        assert torch.equal(stored.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(scales[0].view(-1, num_kv_heads)[slots], row_scales)
        tables.append(table + [0] * (3 - len(table)))
    tables = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    dequantized = [
        tuple(dequantize_kv(*quantize_kv(x, kv_dtype), torch.float32) for x in kv) for kv in seqs_kv
    ]

    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, kv_scales=kv_scales)
    for b, (keys, values) in enumerate(dequantized):
        want = dense_reference(q[b : b + 1], keys, values, scale)
        torch.testing.assert_close(got[b : b + 1], want, atol=1e-5, rtol=1e-5)

    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    got = paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, lens, scale, kv_scales=kv_scales
    )
    for b, (keys, values) in enumerate(dequantized):
        rows = slice(starts[b], starts[b + 1])
        torch.testing.assert_close(
            got[rows], dense_reference(q[rows], keys, values, scale), atol=1e-5, rtol=1e-5
        )


def test_write_kv_puts_each_token_at_its_slot():
    generator = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(6, 16, 2, 8)
    v_cache = torch.zeros(6, 16, 2, 8)
    k = torch.randn(5, 2, 8, generator=generator)
    v = torch.randn(5, 2, 8, generator=generator)
    slots = torch.tensor([3 * 16 + 15, 4 * 16, 0, 5 * 16 + 7, 17])
    write_kv(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 16, slot % 16], k[t])
        assert torch.equal(v_cache[slot // 16, slot % 16], v[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 5


def test_bf16_inputs_give_bf16_outputs_close_to_fp32():
    generator = torch.Generator().manual_seed(2)
    keys, values = (
        torch.randn(40, 2, 16, generator=generator),
        torch.randn(40, 2, 16, generator=generator),
    )
    k_cache, v_cache, tables = scatter_into_cache([(keys, values)], 16, 8, generator)
    q = torch.randn(1, 4, 16, generator=generator)
    lens = torch.tensor([40], dtype=torch.int32)
    want = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    got = paged_decode_attention(
        q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 0.25
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_dispatch_on_cpu_prefers_turbos_native_op_and_honours_the_env_var(monkeypatch):
    expected = "native" if attention.native_problem() is None else "torch"
    assert attention_ops("cpu").name == expected
    assert attention_ops("cpu", torch.int8).name == expected  # turbo's ops read int8 too
    assert attention_ops("cpu", torch.float8_e4m3fn).name == "torch"  # but not fp8
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "torch")
    # plain torch's, on all of a CPU step's threads (cpu_threads.threaded)
    decode = attention_ops("cpu").paged_decode_attention
    assert decode.__wrapped__ is attention.paged_decode_attention
    assert attention_ops("cuda").name == "torch"
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "flash")
    with pytest.raises(OptionError, match="LLMCTL_TORCH_ATTENTION"):
        attention_ops("cpu")
