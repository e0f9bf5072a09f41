"""Paged KV-cache blocks: allocation, reference counts and the prefix cache.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a
block table; blocks holding the same prompt prefix are shared between sequences
(reference counted). A full block whose K/V has been computed gets a key: a SHA-256
digest chained from the previous block's key and the block's own tokens (the first
block's from the sequence's ``cache_salt``: its LoRA adapter), so equal keys mean equal
whole prefixes computed by the same weights. When its last user frees it, a keyed block stays in
the free pool with its contents; a later request with the same prefix takes it back,
until a fresh allocation evicts it (least recently freed first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from llmctl.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: bytes | None = None  # prefix-cache key, set once the block is full and computed


def block_key(parent_key: bytes, token_ids: list[int]) -> bytes:
    """The prefix-cache key of a full block: its tokens chained with its parent's key."""
    return hashlib.sha256(parent_key + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody references, in eviction order: fresh allocations take the first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # key -> block holding that prefix
        # The most blocks in use at once since the start (or reset_peak): a high-water
        # mark kept on every allocation, so no short peak goes unseen.
        self.peak_used_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def reset_peak(self) -> None:
        """Start a new high-water mark from the blocks in use now."""
        self.peak_used_blocks = self.num_used_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``allocate(seq)`` would find enough blocks for all of seq's tokens."""
        hits = self._cached_prefix(seq)
        shared = sum(1 for _, block_id in hits if self.blocks[block_id].ref_count > 0)
        return self.blocks_needed(seq.num_tokens) - shared <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached blocks of its prefix.

        Tokens found in the cache count as computed, so the scheduler skips them.
        """
        assert not seq.block_table, f"{seq.request_id} already has blocks"
        hits = self._cached_prefix(seq)
        for key, block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(key)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_fresh_block())
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens is None:  # the first admission, not a recompute
            seq.num_cached_tokens = seq.num_computed_tokens
        self._note_peak()

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._missing_blocks(seq, num_new_tokens) <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table so its next ``num_new_tokens`` tokens have slots."""
        for _ in range(self._missing_blocks(seq, num_new_tokens)):
            seq.block_table.append(self._take_fresh_block())
        self._note_peak()

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; keyed blocks stay reusable until evicted."""
        # Last block first, so a prefix's tail is evicted before its head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.key is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_computed: int) -> None:
        """Roll ``seq``'s computed K/V back to ``num_computed`` tokens (a speculative step's
        rejected positions) and free the blocks past its tokens. Keyed blocks are never
        touched: their tokens were all accepted."""
        if num_computed > seq.num_computed_tokens:
            raise ValueError(
                f"cannot roll {seq.request_id} forward ({seq.num_computed_tokens} -> "
                f"{num_computed} computed tokens)"
            )
        keep = max(self.blocks_needed(seq.num_tokens), len(seq.block_hashes))
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)  # unkeyed: reuse it first
        del seq.block_table[keep:]
        seq.num_computed_tokens = num_computed

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key seq's full, computed blocks, once their tokens are all on the host (with
        overlapped steps the last one sampled may still be on the device)."""
        if seq.num_computed_tokens <= len(seq.token_ids):
            self.cache_computed_blocks(seq)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Key the blocks of ``seq`` that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            key = block_key(parent, seq.token_ids[index * size : (index + 1) * size])
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[index]]
            # The same prefix may already be cached in another block (two requests
            # computed it at once): keep the first one, leave this one unkeyed.
            if block.key is None and key not in self._cached:
                block.key = key
                self._cached[key] = block.block_id

    def _cached_prefix(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """(key, block) of seq's leading blocks already in the cache.

        At most ``num_tokens - 1`` tokens are matched: the model must run on at least
        the last token to produce the logits of the next one. Nothing for a sequence that
        asked for prompt logprobs it has not got yet.
        """
        if not self.enable_prefix_caching or seq.scores_prompt:
            return []  # a cached prefix has no logits to score its prompt tokens with
        hits: list[tuple[bytes, int]] = []
        parent = seq.cache_salt
        size = self.block_size
        for index in range((seq.num_tokens - 1) // size):
            key = block_key(parent, seq.token_ids[index * size : (index + 1) * size])
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append((key, block_id))
            parent = key
        return hits

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def _missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def _take_fresh_block(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV block (the scheduler should have checked)")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict the prefix it cached
            del self._cached[block.key]
            block.key = None
        block.ref_count = 1
        return block_id
