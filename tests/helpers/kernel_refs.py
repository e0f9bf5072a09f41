"""Plain-torch references of the paged-attention and row kernels, and poisoned inputs.

Shared by turbo's CPU-op tests, its emulated and real CUDA kernel tests: outputs are
filled with NaN before a kernel runs (``poisoned``), and a ``PagedCache`` fills every
slot outside the sequences' contexts with NaN, so a kernel that reads or leaves
anything it should not fails.
"""

from __future__ import annotations

import math

import torch

from llmctl.engine.quant import dequantize_kv, quantize_kv

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def poisoned(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------ references


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def ref_rotary(x: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor):
    angles = positions.float()[:, None] * frequencies[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :]
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), -1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def ref_paged_attention(q, k_cache, v_cache, tables, query_lens, context_lens, scale):
    """Gather each sequence's keys from its blocks, then dense causal attention."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    outputs, start = [], 0
    for table, q_len, ctx in zip(tables, query_lens, context_lens, strict=True):
        blocks = torch.tensor(table, dtype=torch.long)
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        keys = keys.repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[start : start + q_len].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        visible = torch.arange(ctx)[None, :] <= (ctx - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += q_len
    return torch.cat(outputs).to(q.dtype)


# ------------------------------------------------------------------ row ops


class PagedCache:
    """A NaN-filled cache whose sequences own shuffled physical blocks."""

    def __init__(self, block_size, context_lens, kv_heads, head_dim, dtype, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        needed = [math.ceil(c / block_size) for c in context_lens]
        num_blocks = sum(needed) + 3  # spare blocks nobody owns
        order = torch.randperm(num_blocks, generator=generator).tolist()
        self.tables = []
        for count in needed:
            self.tables.append(order[:count])
            order = order[count:]
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = poisoned(*shape, dtype=dtype)
        self.v = poisoned(*shape, dtype=dtype)
        # Fill exactly the slots inside each context with random K/V.
        slots = torch.tensor(
            [
                table[pos // block_size] * block_size + pos % block_size
                for table, ctx in zip(self.tables, context_lens, strict=True)
                for pos in range(ctx)
            ]
        )
        for cache in (self.k, self.v):
            fresh = torch.randn(len(slots), kv_heads, head_dim, generator=generator)
            cache.view(-1, kv_heads, head_dim)[slots] = fresh.to(dtype)

    def padded_tables(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables) + 1  # extra column: never read
        return int32([t + [-7] * (width - len(t)) for t in self.tables])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "part of the output was left unwritten"
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def fused_key_value(tokens: int, kv_heads: int, head_dim: int, dtype, generator):
    """key and value as strided column views of one fused buffer (as in the step), with
    rows of very different magnitudes, and one all-zero row (scale 1)."""
    width = kv_heads * head_dim
    kv = torch.randn(tokens, 2 * width + 5, generator=generator)
    kv *= torch.logspace(-3, 2, tokens)[torch.randperm(tokens, generator=generator), None]
    kv[3, :head_dim] = 0
    kv = kv.to(dtype)
    key = kv[:, :width].view(tokens, kv_heads, head_dim)
    value = kv[:, width : 2 * width].view(tokens, kv_heads, head_dim)
    return key, value


def int8_cache(num_blocks, block_size, kv_heads, head_dim):
    """An int8 cache and its scales holding values no write produces (77, NaN), so that
    an unwritten slot shows."""
    cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 77, dtype=torch.int8)
    return cache, poisoned(num_blocks, block_size, kv_heads)


def check_int8_write(write, dtype, kv_heads, head_dim, block_size, num_blocks, tokens, seed):
    """``write(key, value, k_cache, v_cache, slots, k_scale, v_scale)`` into an int8 cache
    must leave exactly quantize_kv's bytes and scales at the slots, the rest untouched."""
    generator = torch.Generator().manual_seed(seed)
    key, value = fused_key_value(tokens, kv_heads, head_dim, dtype, generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens].to(torch.int32)
    slots[tokens // 3] = -1  # not written
    k_cache, k_scale = int8_cache(num_blocks, block_size, kv_heads, head_dim)
    v_cache, v_scale = int8_cache(num_blocks, block_size, kv_heads, head_dim)
    expected = [t.clone() for t in (k_cache, k_scale, v_cache, v_scale)]
    keep = slots >= 0
    for cache, scale, x in ((expected[0], expected[1], key), (expected[2], expected[3], value)):
        q, s = quantize_kv(x[keep], torch.int8)
        cache.view(-1, kv_heads, head_dim)[slots[keep].long()] = q
        scale.view(-1, kv_heads)[slots[keep].long()] = s

    write(key, value, k_cache, v_cache, slots, k_scale, v_scale)

    for ours, theirs in zip((k_cache, k_scale, v_cache, v_scale), expected, strict=True):
        assert ours.view(torch.uint8).equal(theirs.view(torch.uint8))  # bit for bit, NaN too


def quantized(cache: PagedCache):
    """The float cache's int8 form with its scales, and what that form stands for."""
    (k, k_scale), (v, v_scale) = quantize_kv(cache.k, torch.int8), quantize_kv(cache.v, torch.int8)
    dequantized = [dequantize_kv(q, s, torch.float32) for q, s in ((k, k_scale), (v, v_scale))]
    return (k, v, k_scale, v_scale), dequantized


def ref_lora_add(out, x, a, bt, out_offsets, sizes, token_slots) -> torch.Tensor:
    """``out`` after turbo's LoRA pass, in float64: for each token with a slot (-1: none),
    ``out[t, part p] += (A[s] @ x[t])[p R : (p+1) R] @ Bt[s][:, part p]``, the parts' columns
    of ``Bt`` side by side (``a [slots, parts R, in]``, ``bt [slots, R, sum(sizes)]``)."""
    want = out.double().clone()
    rank = bt.shape[1]
    b_offset = 0
    for p, (offset, size) in enumerate(zip(out_offsets, sizes, strict=True)):
        for t, slot in enumerate(int(s) for s in token_slots):
            if slot >= 0:
                h = a[slot, p * rank : (p + 1) * rank].double() @ x[t].double()
                want[t, offset : offset + size] += (
                    h @ bt[slot, :, b_offset : b_offset + size].double()
                )
        b_offset += size
    return want
