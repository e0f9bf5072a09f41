"""Percentiles against numpy, memory peaks, KV sizes against a real cache tensor."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmctl.bench.metrics import MemoryPeak, summarize


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
        block = b"\x01" * (256 * 2**20)  # written, so resident
        del block
    assert during.peak_bytes >= before.peak_bytes + 200 * 2**20
    assert during.measure == "process_rss"
