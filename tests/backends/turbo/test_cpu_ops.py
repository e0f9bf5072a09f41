"""Each native CPU op against a plain-torch reference written here, on random inputs.

The paged tests scatter every sequence over shuffled physical blocks, fill every cache
slot the op must not read with NaN, and poison outputs with NaN before the call, so a
kernel that reads outside its context or leaves part of its output unwritten fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llmctl_turbo.rope import cos_sin_cache

from llmctl.engine.rope import rope_inv_freq
from tests.helpers.kernel_refs import (
    TOLERANCE,
    PagedCache,
    int32,
    poisoned,
    ref_paged_attention,
    ref_rms_norm,
    ref_rotary,
)

BLOCK_SIZES = [16, 48, 80, 128, 256]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(turbo_ops, dtype):
    torch.manual_seed(1)
    x = (3 * torch.randn(37, 200)).to(dtype)
    weight = (1 + 0.3 * torch.randn(200)).to(dtype)
    out = poisoned(37, 200, dtype=dtype)
    turbo_ops.rms_norm(out, x, weight, 1e-6)
    torch.testing.assert_close(out, ref_rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_residual(turbo_ops, dtype):
    torch.manual_seed(2)
    x = torch.randn(19, 96).to(dtype)
    residual = torch.randn(19, 96).to(dtype)
    weight = (1 + 0.3 * torch.randn(96)).to(dtype)
    expected_residual = residual + x
    out = poisoned(19, 96, dtype=dtype)
    turbo_ops.add_rms_norm(out, residual, x, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, **TOLERANCE[dtype])
    torch.testing.assert_close(
        out, ref_rms_norm(expected_residual, weight, 1e-5), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(turbo_ops, dtype):
    torch.manual_seed(3)
    gate_up = (2 * torch.randn(23, 2 * 172)).to(dtype)
    out = poisoned(23, 172, dtype=dtype)
    turbo_ops.silu_and_mul(out, gate_up)
    expected = F.silu(gate_up[:, :172].float()) * gate_up[:, 172:].float()
    torch.testing.assert_close(out, expected.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "scaling",
    [None, "llama3"],
    ids=["default", "llama3"],
)
def test_rotary_embedding_on_strided_qkv_views(turbo_ops, dtype, scaling):
    from llmctl.model.config import RopeScaling

    torch.manual_seed(4)
    heads, kv_heads, head_dim, tokens = 6, 2, 32, 29
    rope = (
        RopeScaling("llama3", 8.0, 1.0, 4.0, original_max_position_embeddings=64)
        if scaling
        else None
    )
    frequencies = rope_inv_freq(head_dim, 10000.0, rope)
    table = cos_sin_cache(frequencies, 512)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 512, (tokens,), dtype=torch.int32)
    expected_q = ref_rotary(q, positions, frequencies)
    expected_k = ref_rotary(k, positions, frequencies)
    turbo_ops.rotary_embedding(positions, q, k, table)
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("head_dim", [4, 8, 16, 32, 6])
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (5, 3)], ids=["whole", "remainder"])
def test_rotary_embedding_head_dims(turbo_ops, isa, head_dim, heads, kv_heads):
    """Heads narrower than a vector rotate a vector of them at a time, the heads past
    the last whole vector one by one (5 and 3 heads leave some); wider heads (32) and
    widths no vector holds whole (6) take the per-head loop. On each instruction set."""
    torch.manual_seed(head_dim + heads)
    tokens = 37
    frequencies = rope_inv_freq(head_dim, 10000.0, None)
    table = cos_sin_cache(frequencies, 512)
    q = torch.randn(tokens, heads, head_dim)
    k = torch.randn(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 512, (tokens,), dtype=torch.int32)
    expected_q = ref_rotary(q, positions, frequencies)
    expected_k = ref_rotary(k, positions, frequencies)
    turbo_ops.rotary_embedding(positions, q, k, table)
    torch.testing.assert_close(q, expected_q, **TOLERANCE[torch.float32])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[torch.float32])


# ------------------------------------------------------------------ paged ops


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_scatters_and_skips_negative_slots(turbo_ops, block_size, dtype):
    torch.manual_seed(5)
    kv_heads, head_dim, num_blocks, tokens = 2, 16, 9, 40
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(torch.int32)
    slots[7] = -1
    # key and value as strided column views of one fused buffer, as in the step.
    kv = torch.randn(tokens, 2 * kv_heads * head_dim + 5).to(dtype)
    key = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, kv_heads, head_dim)[slots[keep].long()] = key[keep]
    expected_v.view(-1, kv_heads, head_dim)[slots[keep].long()] = value[keep]
    turbo_ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def check_decode_attention(turbo_ops, block_size, dtype, heads, kv_heads, head_dim,
                           context_lens, seed):  # fmt: skip
    """paged_decode_attention over a scattered cache against the reference (q drawn from
    torch's global generator, which the test seeds)."""
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, dtype, seed=seed)
    q = torch.randn(len(context_lens), heads, head_dim).to(dtype)
    out = poisoned(*q.shape, dtype=dtype)
    scale = head_dim**-0.5
    turbo_ops.paged_decode_attention(
        out, q, cache.k, cache.v, cache.padded_tables(), int32(context_lens), scale
    )
    expected = ref_paged_attention(
        q, cache.k, cache.v, cache.tables, [1] * len(context_lens), context_lens, scale
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_paged_decode_attention(turbo_ops, block_size, dtype, heads, kv_heads):
    torch.manual_seed(6)
    context_lens = [1, block_size, block_size + 1, 3 * block_size - 5, 37]
    check_decode_attention(
        turbo_ops, block_size, dtype, heads, kv_heads, 32, context_lens, seed=block_size
    )


@pytest.mark.parametrize("head_dim", [4, 8, 12, 24, 40, 80, 96, 256, 6])
def test_paged_decode_attention_head_dims(turbo_ops, isa, head_dim):
    """Every width the value sums are tiled for (1-8 vectors of 16, 8 or 4 floats, and
    more in slices of 8) and the plain-float fallback (6), on each instruction set."""
    torch.manual_seed(head_dim)
    block_size = 16
    context_lens = [1, 3, block_size, 2 * block_size + 7, 61]
    check_decode_attention(
        turbo_ops, block_size, torch.float32, 6, 2, head_dim, context_lens, seed=head_dim
    )


@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [
        *[(2, 2, 8), (4, 2, 8), (8, 4, 8), (16, 2, 8), (8, 8, 8)],
        *[(4, 4, 4), (8, 4, 4), (16, 4, 4), (16, 8, 4)],
        *[(6, 3, 8), (12, 4, 4)],
    ],
)
def test_paged_decode_attention_narrow_heads(
    turbo_ops, isa, block_size, dtype, heads, kv_heads, head_dim
):
    """Heads narrower than a vector (head_dim 8 or 4), several to a vector in the narrow
    attention kernel: every query-vector count it is built for (1 to 8, so 8 to 1 tokens
    to a vector of scores), GQA ratios 1 to 8, contexts that end mid-vector, and two
    shapes it leaves to the per-head path (a token's kv heads not whole vectors; three
    query vectors). On each instruction set: AVX2 takes head_dim 4 only, the portable
    build neither."""
    torch.manual_seed(heads * 100 + kv_heads * 10 + head_dim)
    context_lens = [1, 2, 3, block_size, block_size + 1, 3 * block_size - 5, 37]
    check_decode_attention(
        turbo_ops, block_size, dtype, heads, kv_heads, head_dim, context_lens, seed=block_size
    )


@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 8), (16, 2, 8), (8, 4, 4), (6, 3, 8)])
def test_paged_prefill_attention_narrow_heads(
    turbo_ops, isa, block_size, heads, kv_heads, head_dim
):
    """The narrow kernel's query rows in a prefill step: fresh prompts, a chunk after
    cached tokens (across a block boundary), decodes and a long prompt in one batch, and
    a shape it leaves to the per-head path; fp32 and bf16, on each instruction set."""
    torch.manual_seed(heads + head_dim)
    query_lens = [5, 1, block_size + 3, 17, 1, 70]
    context_lens = [5, 2 * block_size + 1, block_size + 3, block_size + 20, 9, 70]
    for dtype in DTYPES:
        cache = PagedCache(block_size, context_lens, kv_heads, head_dim, dtype, seed=block_size)
        q = torch.randn(sum(query_lens), heads, head_dim).to(dtype)
        query_start_loc = int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        out = poisoned(*q.shape, dtype=dtype)
        scale = head_dim**-0.5
        turbo_ops.paged_prefill_attention(
            out, q, cache.k, cache.v, cache.padded_tables(), query_start_loc,
            int32(context_lens), scale,
        )  # fmt: skip
        expected = ref_paged_attention(
            q, cache.k, cache.v, cache.tables, query_lens, context_lens, scale
        )
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_prefill_attention_ragged_chunks(turbo_ops, block_size, dtype):
    """Fresh prompts, prompt chunks after cached tokens and decodes in one batch."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim = 8, 2, 16
    query_lens = [5, 1, block_size + 3, 17, 1]
    context_lens = [5, 2 * block_size + 1, block_size + 3, block_size + 20, 9]
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, dtype, seed=block_size + 1)
    q = torch.randn(sum(query_lens), heads, head_dim).to(dtype)
    query_start_loc = int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    out = poisoned(*q.shape, dtype=dtype)
    scale = 0.3
    turbo_ops.paged_prefill_attention(
        out,
        q,
        cache.k,
        cache.v,
        cache.padded_tables(),
        query_start_loc,
        int32(context_lens),
        scale,
    )
    expected = ref_paged_attention(
        q, cache.k, cache.v, cache.tables, query_lens, context_lens, scale
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_attention_query_runs(turbo_ops, block_size):
    """A work item attends for a run of one sequence's query rows: runs cut short where
    their scores would outgrow L2 (16 query heads on one kv head, a long context), and a
    single sequence's rows cut into several runs to keep the threads busy, give the
    reference's output."""
    torch.manual_seed(11)
    heads, kv_heads, head_dim = 16, 1, 32
    query_lens = [9, 1, 5, 20]
    context_lens = [1500, 700, 40, 20]
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, torch.float32, seed=3)
    for seqs in (slice(0, 4), slice(2, 3)):  # the batch; one sequence verifying 5 rows
        lens, contexts = query_lens[seqs], context_lens[seqs]
        tables = cache.padded_tables()[seqs].contiguous()
        q = torch.randn(sum(lens), heads, head_dim)
        out = poisoned(*q.shape, dtype=torch.float32)
        query_start_loc = int32([0, *torch.tensor(lens).cumsum(0).tolist()])
        turbo_ops.paged_prefill_attention(
            out, q, cache.k, cache.v, tables, query_start_loc, int32(contexts), 0.2
        )
        expected = ref_paged_attention(q, cache.k, cache.v, cache.tables[seqs], lens, contexts, 0.2)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 8), (8, 4, 64)], ids=["narrow", "wide"])
@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_paged_attention_many_sequences(turbo_ops, heads, kv_heads, head_dim, step):
    """Enough sequences to split over threads, each thread asking for the cache its next
    row or work item reads while it attends (prefetch_rows in cpu/row_kernels.h): every
    thread count gives the reference's output, bit for bit the same. A decode step's rows,
    and decode rows between prompt chunks; the narrow heads' kernel and the per-head one."""
    generator = torch.Generator().manual_seed(12)
    seqs, block_size = 70, 16
    context_lens = torch.randint(1, 300, (seqs,), generator=generator).tolist()
    if step == "decode":
        query_lens = [1] * seqs
    else:
        query_lens = [min(c, 1 + 8 * (i % 3 == 0)) for i, c in enumerate(context_lens)]
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, torch.float32, seed=5)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=generator)
    query_start_loc = int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    expected = ref_paged_attention(q, cache.k, cache.v, cache.tables, query_lens, context_lens, 0.3)
    before = turbo_ops.cpu_threads()
    outputs = []
    try:
        for count in (1, 2, 3):
            turbo_ops.set_cpu_threads(count)
            out = poisoned(*q.shape, dtype=torch.float32)
            turbo_ops.paged_prefill_attention(
                out, q, cache.k, cache.v, cache.padded_tables(), query_start_loc,
                int32(context_lens), 0.3,
            )  # fmt: skip
            torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
            outputs.append(out)
    finally:
        turbo_ops.set_cpu_threads(before)
    assert all(torch.equal(out, outputs[0]) for out in outputs)


# ------------------------------------------------------------------ bad input


def test_errors_name_the_argument_and_the_rule(turbo_ops):
    k_cache = torch.randn(4, 16, 2, 8)
    q = torch.randn(2, 4, 8)
    out = torch.empty_like(q)
    tables = int32([[0, 1], [2, 3]])
    with pytest.raises(RuntimeError, match="context_lens must be Int"):
        turbo_ops.paged_decode_attention(
            out, q, k_cache, k_cache, tables, torch.tensor([3, 4]), 1.0
        )
    with pytest.raises(RuntimeError, match=r"block_tables\[1\]\[0\] = 9 is outside"):
        turbo_ops.paged_decode_attention(
            out, q, k_cache, k_cache, int32([[0], [9]]), int32([3, 4]), 1.0
        )
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        turbo_ops.paged_decode_attention(out, q, k_cache, k_cache, tables, int32([3, 40]), 1.0)
    with pytest.raises(RuntimeError, match="run in float32, bfloat16 or float16, but q is Double"):
        turbo_ops.paged_decode_attention(
            out, q.double(), k_cache, k_cache, tables, int32([3, 4]), 1.0
        )
    with pytest.raises(RuntimeError, match="slot_mapping\\[1\\] = 64 is outside"):
        key = torch.randn(2, 2, 8)
        turbo_ops.write_kv_cache(key, key, k_cache, k_cache.clone(), int32([0, 64]))
    with pytest.raises(RuntimeError, match="positions\\[0\\] = 600 has no row"):
        turbo_ops.rotary_embedding(int32([600, 1]), q, q[:, :2].clone(), torch.randn(512, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [21, 600])
def test_rotary_embedding_and_write_kv_is_rotary_then_write(turbo_ops, dtype, tokens):
    """The op the CUDA step fuses; on the CPU one parallel loop over the tokens does both
    (600 tokens: several chunks, on every thread)."""
    from tests.backends.turbo.kernel_checks import check_rotary_and_write_kv

    check_rotary_and_write_kv(
        turbo_ops.rotary_embedding_and_write_kv, turbo_ops, dtype, tokens=tokens, num_blocks=24
    )
