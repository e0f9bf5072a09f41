"""The block manager's high-water mark: the most blocks ever in use at once, exact
after any sequence of allocations and frees (a figure sampled on a timer can miss a
short peak; this one cannot)."""

from __future__ import annotations

import random

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.sequence import Sequence


def test_the_peak_is_the_most_blocks_ever_in_use() -> None:
    rng = random.Random(0)
    manager = BlockManager(num_blocks=40, block_size=4)
    prefixes = [[rng.randrange(1, 100) for _ in range(8)] for _ in range(3)]  # cache hits
    live: list[Sequence] = []
    most = 0
    for i in range(2000):
        action = rng.random()
        if action < 0.4:
            tokens = rng.choice(prefixes) + [
                rng.randrange(1, 100) for _ in range(rng.randint(1, 9))
            ]
            seq = Sequence(f"r{i}", tokens, SamplingParams())
            if manager.can_allocate(seq):
                manager.allocate(seq)
                live.append(seq)
        elif action < 0.7 and live:
            seq = rng.choice(live)
            count = rng.randint(1, 6)
            if manager.can_append(seq, count):
                manager.append_slots(seq, count)
                seq.num_computed_tokens = min(seq.num_computed_tokens + count, seq.num_tokens)
                manager.cache_computed_blocks(seq)
        elif live:
            manager.free(live.pop(rng.randrange(len(live))))
        most = max(most, manager.num_used_blocks)
        assert manager.peak_used_blocks == most
    assert 0 < most <= 40
    manager.reset_peak()
    assert manager.peak_used_blocks == manager.num_used_blocks
