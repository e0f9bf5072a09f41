"""The runner's ``StepBatch``, built from rows that running sequences keep between steps.

Each running sequence owns a row of one block-table array: its table is copied there
when it is admitted, and afterwards only the blocks it gains are written. A step's
arrays (positions, slots, context lengths, its rows of block tables) then come from
numpy over the step's rows, with no Python work per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmctl.engine.runner import SampledTokenFill, StepBatch
from llmctl.engine.sequence import Sequence
from llmctl.engine.transfer import to_device


@dataclass
class ScheduledStep:
    """The sequences of one step and what each feeds the model.

    ``starts[i]`` is where ``seqs[i]``'s new tokens begin (its computed tokens when
    scheduled) and ``num_new_tokens[i]`` how many there are; ``input_ids`` is all of them
    flattened, with -1 where a token is still on the device (``pending``: its index in
    ``input_ids`` and the sequence). ``ready`` lists the rows that sample a token (a
    decode, or the last chunk of a prefill).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    pending: list[tuple[int, Sequence]] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, count: int) -> None:
        start = seq.num_computed_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(count)
        self.starts.append(start)
        self.rows.append(seq.row)
        if seq.num_pending_tokens:  # a decode of the token the step in flight samples
            self.pending.append((len(self.input_ids), seq))
            self.input_ids.append(-1)
        elif count == 1:
            self.input_ids.append(seq.token_ids[start])
        else:
            self.input_ids += seq.token_ids[start : start + count]
        if start + count == len(seq.token_ids) + seq.num_pending_tokens:
            self.ready.append(len(self.seqs) - 1)


class StepInputs:
    def __init__(self, block_size: int, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self._table_lens = [0] * max_num_seqs  # entries of each row already written
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def admit(self, seq: Sequence) -> None:
        """Give a sequence that starts running a row, with its block table."""
        seq.row = self._free_rows.pop()
        self._table_lens[seq.row] = 0
        self.sync_table(seq)

    def release(self, seq: Sequence) -> None:
        self._free_rows.append(seq.row)
        seq.row = None

    def sync_table(self, seq: Sequence) -> None:
        """Write the blocks ``seq`` gained since its row was last written."""
        row, table = seq.row, seq.block_table
        known = self._table_lens[row]
        if len(table) > known:
            self.block_tables[row, known : len(table)] = table[known:]
            self._table_lens[row] = len(table)

    def build(self, step: ScheduledStep) -> StepBatch:
        rows = np.array(step.rows, dtype=np.intp)
        starts = np.array(step.starts, dtype=np.int32)
        counts = np.array(step.num_new_tokens, dtype=np.int32)
        num_tokens = len(step.input_ids)
        if num_tokens == len(rows):  # one token each (decodes): no expansion needed
            positions, token_rows = starts, rows
        else:
            first_token = np.cumsum(counts) - counts
            positions = (
                np.arange(num_tokens, dtype=np.int32) - np.repeat(first_token - starts, counts)
            ).astype(np.int32)
            token_rows = np.repeat(rows, counts)
        size = self.block_size
        slots = self.block_tables[token_rows, positions // size] * size + positions % size
        context_lens = starts + counts
        width = int(context_lens.max() + size - 1) // size
        return StepBatch(
            input_ids=np.array(step.input_ids, dtype=np.int32),
            positions=positions,
            query_lens=counts,
            context_lens=context_lens,
            block_tables=self.block_tables[rows, :width],
            slot_mapping=slots.astype(np.int32),
            sampled_tokens=_sampled_token_fill(step.pending),
        )


def _sampled_token_fill(pending: list[tuple[int, Sequence]]) -> SampledTokenFill | None:
    """Where the input tokens still on the device come from: all of them were sampled by
    the one step in flight, so they are rows of its ``token_ids``."""
    if not pending:
        return None
    source = pending[0][1].pending[0].token_ids
    indices = to_device([index for index, _ in pending], torch.int64, source.device)
    rows = to_device([seq.pending[1] for _, seq in pending], torch.int64, source.device)
    return SampledTokenFill(token_indices=indices, token_ids=source[rows])
