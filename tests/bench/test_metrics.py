"""Percentiles against numpy, memory peaks, KV sizes against a real cache tensor."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmctl.bench.metrics import MemoryPeak, kv_bytes_per_token, resolve_dtype, summarize


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_summarize_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(0.1) for _ in range(n)]
    summary = summarize(values)
    assert summary["mean"] == pytest.approx(np.mean(values))
    for q in (50, 90, 99):
        assert summary[f"p{q}"] == pytest.approx(np.percentile(values, q))


def test_summarize_of_nothing_is_none() -> None:
    assert summarize([]) is None


def test_memory_peak_sees_a_temporary_allocation() -> None:
    with MemoryPeak(cuda=False, interval_s=0.001) as before:
        pass
    with MemoryPeak(cuda=False, interval_s=0.001) as during:
        block = bytearray(256 * 2**20)  # touched pages: resident
        del block
    assert during.peak_bytes >= before.peak_bytes + 200 * 2**20
    assert during.measure == "process_rss"


def test_kv_bytes_per_token_matches_a_real_cache_tensor() -> None:
    import torch

    config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 256,
    }
    dtype = resolve_dtype(config, "auto", cuda=False)
    assert dtype == "float32"
    layers, kv_heads, head_dim, tokens = 3, 2, 256 // 8, 10
    cache = torch.empty(layers, 2, tokens, kv_heads, head_dim, dtype=getattr(torch, dtype))
    expected = cache.element_size() * cache.nelement() // tokens
    assert kv_bytes_per_token(config, dtype) == expected


def test_resolve_dtype() -> None:
    config = {"torch_dtype": "bfloat16"}
    assert resolve_dtype(config, "auto", cuda=True) == "bfloat16"
    assert resolve_dtype(config, "auto", cuda=False) == "float32"
    assert resolve_dtype(config, "float16", cuda=False) == "float16"
