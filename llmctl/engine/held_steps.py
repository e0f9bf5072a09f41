"""A steady decode's held tokens, kept by step instead of by sequence.

In the scheduler's repeat steps (every running sequence one decode token) of requests
that wait for their next output (``Sequence.hold_below``), a new token only lengthens its
sequence. Yet writing it there right after the model call costs a cache miss for each
sequence, more than the rest of the step's host work. So ``HeldSteps`` keeps such a
step's tokens in the list the sampler returned, finds the rows that need more (a stop
id or a token without a table entry: one set lookup over the batch; an output due: each
row's next output kept as the step it falls on), and brings a sequence up to date
(``sync``) only where something reads it: the full checks of one of its tokens, the
scheduler giving it a block, a step that is no repeat, a finish or an abort (``end``).
Until then the sequence's ``token_ids``, ``num_computed_tokens`` and ``num_held_tokens``
lack the steps it was not synced with.

Only where nothing else reads a sequence between steps: no speculative decoding, and no
sampling that reads a request's tokens (penalties, min_tokens, a grammar;
``LLMEngine._may_hold``). Where steps overlap (the GPU), the scheduler marks each step's
K/V as it launches it, a step before its tokens come: there a sync appends tokens and
keys the blocks they complete, and marks nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from typing import Any, Protocol

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.sequence import Sequence


class Step(Protocol):
    """What is read here of a ``scheduler.ScheduledStep`` (that module imports this one)."""

    seqs: list[Sequence]
    repeats: Any


class HeldSteps:
    def __init__(
        self,
        block_manager: BlockManager,
        num_texts: int,
        untabled: frozenset[int],
        overlap: bool,
    ) -> None:
        """``num_texts``, ``untabled``: the detokenizer's text table (``TokenPieces``): a
        token is held only with a table entry (the engine starts no chain without a table).
        ``overlap``: steps overlap, and the scheduler marks every step's K/V."""
        self.block_manager = block_manager
        self.marks_computed = not overlap
        self.num_texts = num_texts
        self._untabled = untabled
        self._unholdable = untabled  # the same and the chain's stop ids, of any row
        self._stop_sets: frozenset[frozenset[int]] = frozenset()
        self.step: Step | None = None  # the chain's last step; None: no chain
        self._seqs: list[Sequence] = []
        self._steps: list[list[int]] = []  # each held step's tokens, one per row
        self._synced: list[int] = []  # per row: how many of those its sequence has
        # Per row: the first step (index in ``_steps``) whose token it may not hold (an
        # output is due), and the least of those. Plain Python, as below: right after the
        # model call each numpy call costs several µs, more than these loops.
        self._limits: list[int] = []
        self._next_limit = 0

    def covers(self, step: Step) -> bool:
        """Whether ``step`` continues the chain: its K/V is marked and its tokens are
        appended here (``hold``), not by the scheduler and the engine's loop."""
        return self.step is not None and step.repeats is self.step

    def start(self, step: Step) -> None:
        """Begin a chain after ``step``, whose tokens every sequence has: the repeats of
        it hold their rows' tokens while those rows have room."""
        seqs = step.seqs
        stop_sets = frozenset(seq.stop_token_ids for seq in seqs)
        if stop_sets != self._stop_sets:  # a stop id of any row takes the full checks
            self._unholdable = self._untabled.union(*stop_sets)
            self._stop_sets = stop_sets
        self.step = step
        self._seqs = seqs
        self._steps = []
        self._synced = [0] * len(seqs)
        self._limits = [seq.hold_below - len(seq.token_ids) for seq in seqs]
        self._next_limit = min(self._limits)

    def hold(self, step: Step, token_ids: list[int]) -> list[int]:
        """Keep the tokens of ``step`` (covered: one per row); the rows that need the full
        checks, each synced with the steps before and this step's K/V marked: their
        tokens are the caller's to append."""
        self.step = step
        current = len(self._steps)
        self._steps.append(token_ids)
        rows = []
        if current >= self._next_limit:  # an output is due for some
            rows = [index for index, limit in enumerate(self._limits) if limit <= current]
        unholdable = self._unholdable.intersection(token_ids)
        if unholdable or max(token_ids) >= self.num_texts:
            num_texts = self.num_texts
            rows = sorted(
                set(rows).union(
                    index
                    for index, token_id in enumerate(token_ids)
                    if token_id in unholdable or token_id >= num_texts
                )
            )
        self._sync_rows(rows, current)
        synced, seqs = self._synced, self._seqs
        for index in rows:
            synced[index] += 1  # this step's token is the caller's
            self._mark(seqs[index], 1)
        return rows

    def reopen(self, rows: list[int]) -> None:
        """``rows`` went through the full checks: the tokens each may hold now."""
        if self.step is None:  # one finished: the chain ended
            return
        if rows:
            limits, seqs, end = self._limits, self._seqs, len(self._steps)
            for index in rows:
                seq = seqs[index]
                limits[index] = end + seq.hold_below - len(seq.token_ids)
            self._next_limit = min(limits)

    def sync(self, rows: list[int]) -> None:
        """Bring the sequences of ``rows`` up to date (the scheduler is about to give
        them blocks)."""
        if self.step is not None:
            self._sync_rows(rows, len(self._steps))

    def end(self) -> None:
        """Bring every sequence up to date and end the chain."""
        if self.step is None:
            return
        self._sync_rows(range(len(self._seqs)), len(self._steps))
        self.step = None
        self._seqs, self._steps, self._synced, self._limits = [], [], [], []

    def _sync_rows(self, rows: Sequence_[int], end: int) -> None:
        """Append the tokens of the held steps before ``end`` to the sequences of
        ``rows``. For many rows the steps are turned into columns at once."""
        steps, synced = self._steps, self._synced
        columns, first = None, 0
        if len(rows) * 8 >= len(synced):
            first = min((synced[index] for index in rows), default=end)
            columns = list(zip(*steps[first:end]))  # per row, its tokens since ``first``
        for index in rows:
            done = synced[index]
            if done >= end:
                continue
            if columns is None:
                tokens = [step_tokens[index] for step_tokens in steps[done:end]]
            else:
                tokens = columns[index][done - first :]
            seq = self._seqs[index]
            seq.token_ids += tokens
            seq.num_held_tokens += end - done
            self._mark(seq, end - done)
            synced[index] = end

    def _mark(self, seq: Sequence, num_tokens: int) -> None:
        """As ``Scheduler.mark_computed`` does: the K/V of ``num_tokens`` more positions is
        computed (unless the scheduler marked it: overlapped steps), and the blocks it
        filled are keyed once their tokens are all here."""
        if self.marks_computed:
            seq.num_computed_tokens += num_tokens
        manager = self.block_manager
        if manager.enable_prefix_caching and (
            seq.num_computed_tokens // manager.block_size > len(seq.block_hashes)
        ):
            manager.cache_full_blocks(seq)
