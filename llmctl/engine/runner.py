"""The interface between the shared engine (scheduler, block manager, sampler) and a backend.

A backend plugs its model into the shared engine by implementing ``ModelRunner``:
the engine schedules, the runner runs one forward step over a flattened batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class StepBatch:
    """One scheduler step: the new tokens of every scheduled sequence, flattened.

    Sequence ``i`` contributes ``query_lens[i]`` new tokens (a prefill chunk, or 1 for
    decode). Its KV cache holds ``context_lens[i]`` tokens once this step has written
    the new ones, so its new tokens sit at positions
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``.
    ``slot_mapping[t]`` is the physical cache slot (``block * block_size + offset``)
    where new token ``t`` writes its K/V.
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class ModelRunner(Protocol):
    """Runs a model over paged KV blocks. Built by a backend, driven by the shared engine."""

    block_size: int
    num_blocks: int

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return fp32 logits ``[num_seqs, vocab]``
        for the last new token of each sequence."""
        ...
