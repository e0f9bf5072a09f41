"""The paged KV block manager: invariants under random operations, prefix-cache hits."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.sequence import Sequence

BLOCK = 4


def make_seq(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, tokens, SamplingParams())


def compute(manager: BlockManager, seq: Sequence, count: int, written: dict) -> None:
    """What a model step does to the cache: write ``count`` tokens' K/V, then key blocks.

    A token's K/V depends on every token up to it, so ``written`` records that prefix.
    """
    manager.append_slots(seq, count)
    for position in range(seq.num_computed_tokens, seq.num_computed_tokens + count):
        block = seq.block_table[position // BLOCK]
        # A block is only ever written by its single owner.
        assert manager.blocks[block].ref_count == 1
        written[(block, position % BLOCK)] = tuple(seq.token_ids[: position + 1])
    seq.num_computed_tokens += count
    manager.cache_computed_blocks(seq)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of allocate / compute / sample / free over shared prefixes."""

    @initialize(num_blocks=st.integers(1, 24), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.manager = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
        self.live: list[Sequence] = []
        # (block, offset) -> the token prefix whose K/V that slot holds
        self.written: dict[tuple[int, int], tuple[int, ...]] = {}
        self.counter = 0

    # Prompts are drawn from a tiny alphabet over a few shared stems, so prefixes repeat
    # (and the block 5 6 7 8 follows two different first blocks).
    @rule(
        stem=st.sampled_from(
            [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 5, 6, 7, 8]]
        ),
        tail=st.lists(st.integers(0, 2), max_size=9),
    )
    def admit(self, stem: list[int], tail: list[int]) -> None:
        tokens = stem + tail or [0]
        self.counter += 1
        seq = make_seq(tokens, f"r{self.counter}")
        if self.manager.can_allocate(seq):
            free_before = self.manager.num_free_blocks
            self.manager.allocate(seq)
            assert seq.num_computed_tokens < seq.num_tokens
            assert len(seq.block_table) == self.manager.blocks_needed(seq.num_tokens)
            assert free_before - self.manager.num_free_blocks <= len(seq.block_table)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        remaining = seq.num_tokens - seq.num_computed_tokens
        count = data.draw(st.integers(1, remaining))
        if self.manager.can_append(seq, count):
            compute(self.manager, seq, count, self.written)
            if seq.num_computed_tokens == seq.num_tokens:  # fully computed: sample a token
                seq.token_ids.append(data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.manager.free(seq)
        assert seq.block_table == []

    @invariant()
    def reference_counts_match_owners(self) -> None:
        owners = [0] * self.manager.num_blocks
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), "block twice in one table"
            for block in seq.block_table:
                owners[block] += 1
        for block in self.manager.blocks:
            assert block.ref_count == owners[block.block_id]

    @invariant()
    def free_pool_is_exactly_the_unreferenced_blocks(self) -> None:
        free = list(self.manager._free)
        assert len(free) == len(set(free)) == self.manager.num_free_blocks
        assert set(free) == {b.block_id for b in self.manager.blocks if b.ref_count == 0}
        assert self.manager.num_used_blocks + self.manager.num_free_blocks == (
            self.manager.num_blocks
        )

    @invariant()
    def cache_index_is_consistent(self) -> None:
        for key, block_id in self.manager._cached.items():
            assert self.manager.blocks[block_id].key == key
        keyed = [b for b in self.manager.blocks if b.key is not None]
        assert len(keyed) == len(self.manager._cached)

    @invariant()
    def computed_tokens_are_in_their_slots(self) -> None:
        """Every token a sequence counts as computed (its own or a reused prefix) is
        really what that slot holds: a reused block's whole prefix matches."""
        for seq in self.live:
            for position in range(seq.num_computed_tokens):
                block = seq.block_table[position // BLOCK]
                expected = tuple(seq.token_ids[: position + 1])
                assert self.written.get((block, position % BLOCK)) == expected


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_prefix_cache_hit_reuses_full_computed_blocks() -> None:
    manager = BlockManager(16, BLOCK)
    first = make_seq(list(range(10)), "a")
    manager.allocate(first)
    compute(manager, first, 10, {})
    second = make_seq(list(range(9)) + [99], "b")
    manager.allocate(second)
    assert second.num_computed_tokens == 8  # two full blocks shared
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert manager.blocks[first.block_table[0]].ref_count == 2


def test_prefix_cache_miss_on_different_earlier_block() -> None:
    """Block 2 holds the same tokens, but its prefix differs: no reuse."""
    manager = BlockManager(16, BLOCK)
    first = make_seq([1, 1, 1, 1, 5, 6, 7, 8, 0], "a")
    manager.allocate(first)
    compute(manager, first, 9, {})
    second = make_seq([2, 2, 2, 2, 5, 6, 7, 8, 0], "b")
    manager.allocate(second)
    assert second.num_computed_tokens == 0


def test_freed_cached_blocks_are_reused_until_evicted() -> None:
    manager = BlockManager(4, BLOCK)
    first = make_seq(list(range(9)), "a")
    manager.allocate(first)
    compute(manager, first, 9, {})
    manager.free(first)
    assert manager.num_free_blocks == 4
    again = make_seq(list(range(9)), "b")
    manager.allocate(again)
    assert again.num_computed_tokens == 8
    manager.free(again)
    # Three unrelated blocks evict the least recently freed ones; block 0 survives longest.
    other = make_seq([50] * 12, "c")
    manager.allocate(other)
    manager.free(other)
    assert make_seq(list(range(9)), "d").num_computed_tokens == 0
    last = make_seq(list(range(9)), "e")
    manager.allocate(last)
    assert last.num_computed_tokens == 4  # only the first block was still cached


def test_last_token_is_always_recomputed() -> None:
    manager = BlockManager(8, BLOCK)
    first = make_seq(list(range(8)), "a")
    manager.allocate(first)
    compute(manager, first, 8, {})
    same = make_seq(list(range(8)), "b")
    manager.allocate(same)
    assert same.num_computed_tokens == 4  # at most num_tokens - 1 tokens are reused


def test_no_caching_when_disabled() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=False)
    first = make_seq(list(range(9)), "a")
    manager.allocate(first)
    compute(manager, first, 9, {})
    second = make_seq(list(range(9)), "b")
    manager.allocate(second)
    assert second.num_computed_tokens == 0
    assert not manager._cached


def test_free_returns_every_block() -> None:
    manager = BlockManager(8, BLOCK)
    seqs = [make_seq(list(range(n)), str(n)) for n in (3, 9, 13)]
    for seq in seqs:
        manager.allocate(seq)
        compute(manager, seq, seq.num_tokens - seq.num_computed_tokens, {})
    assert manager.num_free_blocks < 8
    for seq in seqs:
        manager.free(seq)
    assert manager.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in manager.blocks)
