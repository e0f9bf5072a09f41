"""How many KV-cache blocks an engine allocates, from ``cache_max_entry_count``."""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.errors import OptionError
from llmctl.kv_budget import KVBudget, format_bytes


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    note: str = ""  # why the budget was not used as given, if it was not
    element: str = ""  # what the cache stores ("float32", "int8 + scales"), if known

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        text = (
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.num_bytes / 2**30:.2f} GiB"
        )
        details = "; ".join(filter(None, (self.element, self.note)))
        return f"{text} ({details})" if details else text


def plan_kv_cache(
    budget: KVBudget,
    bytes_per_block: int,
    free_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    element: str = "",
) -> KVPlan:
    """Blocks to allocate for ``budget``, given one block's size and the memory free now.

    A fraction or a size is an upper bound: it is capped at what ``max_num_seqs``
    full-length sequences could ever use, so a tiny model on a big machine does not
    take most of its memory. A block count is taken as given, but must fit in free
    memory. Refused (``OptionError``) when the cache cannot hold one full-length request.
    """
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = budget.num_blocks(bytes_per_block, free_bytes)
    note = ""
    if budget.kind == "blocks":
        if num_blocks * bytes_per_block > free_bytes:
            raise OptionError(
                f"cache_max_entry_count={num_blocks} blocks needs "
                f"{format_bytes(num_blocks * bytes_per_block)} but only "
                f"{format_bytes(free_bytes)} is free: ask for at most "
                f"{free_bytes // bytes_per_block} blocks, or a fraction such as 0.8"
            )
    elif num_blocks > max_num_seqs * blocks_per_seq:
        num_blocks = max_num_seqs * blocks_per_seq
        note = (
            f"capped from {budget}: enough for max_batch_size={max_num_seqs} sequences "
            f"of session_len={max_model_len}"
        )
    if num_blocks < blocks_per_seq:
        raise OptionError(
            f"the KV cache budget cache_max_entry_count={budget} gives {num_blocks} blocks "
            f"x {block_size} tokens = {num_blocks * block_size} tokens "
            f"({format_bytes(bytes_per_block)} per block), but one request of "
            f"session_len={max_model_len} needs {blocks_per_seq} blocks: raise "
            "cache_max_entry_count or lower session_len"
        )
    return KVPlan(num_blocks, block_size, bytes_per_block, note, element)
