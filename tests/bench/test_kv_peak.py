"""``peak_kv_blocks_used`` in a throughput run is the block manager's high-water mark
over the workload alone (the warm-up's blocks reset away): exact, whatever the timing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from llmctl.bench.metrics import MemoryPeak
from llmctl.bench.throughput import run_engine_throughput
from llmctl.bench.workload import BenchRequest, LengthRange, Workload
from llmctl.selection import select


def test_the_peak_counts_the_workload_not_the_warm_up(stories_dir: Path) -> None:
    flags = {"backend": "torch", "cache_block_seq_len": 16, "cache_max_entry_count": 64}
    engine = select(str(stories_dir), flags).create_engine()
    warmup = BenchRequest(list(range(10, 50)), 8)  # 48 tokens: 3 blocks of 16
    # One request of 4 + 2 tokens: one block, over in a few milliseconds.
    workload = Workload([BenchRequest([5, 6, 7, 8], 2)], LengthRange(4, 4), LengthRange(2, 2), 0)

    async def run() -> dict:
        try:
            return await run_engine_throughput(engine, workload, MemoryPeak(False), warmup=warmup)
        finally:
            await engine.shutdown()

    result = asyncio.run(run())
    assert result["peak_kv_blocks_used"] == 1
    assert engine.stats().kv_blocks_peak == 1
