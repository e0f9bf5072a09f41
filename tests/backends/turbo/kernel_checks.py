"""Cases and checks shared by the CUDA kernel tests: on the GPU (test_cuda_kernels.py)
and in the CPU emulator (test_cuda_emulated.py).

Each check builds fresh random inputs on the CPU (caches NaN outside every context,
outputs NaN before the call), runs the kernel under test through ``run`` (a function of
CPU tensors that moves them wherever it likes and writes the output in place), and
compares with plain torch (test_cpu_ops.py's references) and with turbo's CPU op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.helpers.kernel_refs import (
    PagedCache,
    int32,
    poisoned,
    ref_lora_add,
    ref_paged_attention,
    ref_rotary,
)

# Block sizes turbo accepts on CUDA (multiples of 32 on compute capability >= 8.0).
CUDA_BLOCK_SIZES = [32, 64, 96, 128, 256]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (query heads, KV heads, head_dim): GQA ratios 1, 4 and 8; the last head_dim is padded
# inside the kernels.
GQA_SHAPES = [(4, 4, 128), (8, 2, 64), (16, 2, 16)]
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}

Run = Callable[..., object]


def decode_contexts(block_size: int) -> list[int]:
    """One token, exactly one block, one past it, mid-block, and a short odd one."""
    return [1, block_size, block_size + 1, 3 * block_size - 5, 37]


def check_decode(run: Run, turbo_ops, block_size, dtype, heads, kv_heads, head_dim,
                 context_lens, seed=0):  # fmt: skip
    """``run(out, q, k_cache, v_cache, block_tables, context_lens, scale)``; returns what
    run returned."""
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(len(context_lens), heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    tables, lens = cache.padded_tables(), int32(context_lens)
    out = poisoned(*q.shape, dtype=dtype)
    result = run(out, q, cache.k, cache.v, tables, lens, scale)
    expected = ref_paged_attention(
        q, cache.k, cache.v, cache.tables, [1] * len(context_lens), context_lens, scale
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    cpu_out = poisoned(*q.shape, dtype=dtype)
    turbo_ops.paged_decode_attention(cpu_out, q, cache.k, cache.v, tables, lens, scale)
    torch.testing.assert_close(out, cpu_out, **TOLERANCE[dtype])
    return result


def check_prefill(run: Run, turbo_ops, block_size, dtype, heads, kv_heads, head_dim, seed=0):
    """``run(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
    scale)`` on a batch of fresh prompts, chunks after cached context (also across a
    block boundary), decode tokens and a prompt longer than one 64-row tile."""
    query_lens = [5, 1, block_size + 3, 17, 1, 70]
    context_lens = [5, 2 * block_size + 1, block_size + 3, block_size + 20, 9, 70 + block_size // 2]
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=generator).to(dtype)
    query_start_loc = int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    scale = head_dim**-0.5
    tables, lens = cache.padded_tables(), int32(context_lens)
    out = poisoned(*q.shape, dtype=dtype)
    run(out, q, cache.k, cache.v, tables, query_start_loc, lens, scale)
    expected = ref_paged_attention(
        q, cache.k, cache.v, cache.tables, query_lens, context_lens, scale
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    cpu_out = poisoned(*q.shape, dtype=dtype)
    turbo_ops.paged_prefill_attention(
        cpu_out, q, cache.k, cache.v, tables, query_start_loc, lens, scale
    )
    torch.testing.assert_close(out, cpu_out, **TOLERANCE[dtype])


def check_rotary_and_write_kv(
    run: Run, turbo_ops, dtype, block_size=32, seed=0, tokens=21, num_blocks=4
):
    """``run(positions, q, k, v, cos_sin, k_cache, v_cache, slots)`` rotates q and k in
    place and writes the rotated k and v to the cache; q, k and v are strided column
    views of one fused qkv buffer, as in the native step, and one slot is -1 (skipped)."""
    from llmctl_turbo.rope import cos_sin_cache

    from llmctl.engine.rope import rope_inv_freq

    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = 8, 2, 64
    frequencies = rope_inv_freq(head_dim, 10000.0, None)
    table = cos_sin_cache(frequencies, 512)
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(tokens, sum(widths), generator=generator).to(dtype)
    q, k, v = (
        part.view(tokens, -1, head_dim) for part in qkv.split(widths, dim=1)
    )  # views: rows strided by the fused width
    positions = torch.randint(0, 512, (tokens,), generator=generator, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens].to(torch.int32)
    slots[3] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = poisoned(*shape, dtype=dtype), poisoned(*shape, dtype=dtype)

    expected_q, expected_k = (
        ref_rotary(q, positions, frequencies),
        ref_rotary(k, positions, frequencies),
    )
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    keep = (slots >= 0).nonzero().flatten()
    expected_k_cache.view(-1, kv_heads, head_dim)[slots[keep].long()] = expected_k[keep]
    expected_v_cache.view(-1, kv_heads, head_dim)[slots[keep].long()] = v[keep]
    # turbo's CPU ops, unfused, on copies.
    cpu_q, cpu_k = q.clone(), k.clone()
    cpu_k_cache, cpu_v_cache = k_cache.clone(), v_cache.clone()
    turbo_ops.rotary_embedding(positions, cpu_q, cpu_k, table)
    turbo_ops.write_kv_cache(cpu_k, v, cpu_k_cache, cpu_v_cache, slots)

    run(positions, q, k, v, table, k_cache, v_cache, slots)
    for got, want, cpu in [
        (q, expected_q, cpu_q),
        (k, expected_k, cpu_k),
        (k_cache, expected_k_cache, cpu_k_cache),
        (v_cache, expected_v_cache, cpu_v_cache),
    ]:
        torch.testing.assert_close(got, want, equal_nan=True, **TOLERANCE[dtype])
        torch.testing.assert_close(got, cpu, equal_nan=True, **TOLERANCE[dtype])


# ------------------------------------------------------------------ LoRA (csrc/cuda/lora.cu)

MAX_LORAS = 4
LORA_ROWS = [*range(1, 21), 64]
# (name, out_offsets, sizes, output width): the parts of turbo's fused linears.
LORA_PARTS = [
    ("one", [0], [70], 70),  # o_proj / down: fewer columns than a block's 128
    ("qkv", [0, 40, 64], [40, 24, 24], 88),  # q, k, v side by side
    ("gate_up", [0, 150], [150, 150], 300),  # gate, up: more columns than one block
]


def random_slots(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Per-row slots: runs of one slot (prompt chunks) and single rows (decodes), -1 among
    them, so tiles hold one slot, several, or none."""
    slots: list[int] = []
    while len(slots) < rows:
        slot = int(torch.randint(-1, MAX_LORAS, (1,), generator=generator))
        run = int(torch.randint(1, 6, (1,), generator=generator))
        slots += [slot] * run
    return int32(slots[:rows])


def check_lora_add(lora_add, dtype, rows, rank, parts, in_features, seed, slots=None):
    """``lora_add(out, x, a, bt, out_offsets, sizes, slots)`` (the emulated kernels, or the
    real op on a GPU: test_cuda_kernels.py) against ``ref_lora_add`` on fresh inputs."""
    _, out_offsets, sizes, width = parts
    generator = torch.Generator().manual_seed(seed)
    slots = random_slots(rows, generator) if slots is None else slots
    a = torch.randn(MAX_LORAS, len(sizes) * rank, in_features, generator=generator) / 4
    bt = torch.randn(MAX_LORAS, rank, sum(sizes), generator=generator) / 4
    # x and out as strided views (turbo's fused rows are), out with spare columns.
    x = torch.randn(rows, in_features + 5, generator=generator).to(dtype)[:, 2 : 2 + in_features]
    wide = torch.randn(rows, width + 7, generator=generator).to(dtype)
    out = wide[:, 3 : 3 + width]
    before = wide.clone()
    want = ref_lora_add(out, x, a, bt, out_offsets, sizes, slots)

    lora_add(out, x, a, bt, out_offsets, sizes, slots)

    torch.testing.assert_close(out.double(), want.to(dtype).double(), **TOLERANCE[dtype])
    base = slots < 0
    assert torch.equal(wide[base], before[base]), "a row without an adapter changed"
    covered = torch.zeros(wide.shape[1], dtype=torch.bool)
    for offset, size in zip(out_offsets, sizes, strict=True):
        covered[3 + offset : 3 + offset + size] = True
    assert torch.equal(wide[:, ~covered], before[:, ~covered]), "a column outside the parts changed"
