"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step first continues the running sequences (one decode token each, or the next
chunk of a prompt still being prefilled), then admits waiting ones with what is left
of the step's token budget (``max_num_batched_tokens``) and sequence budget
(``max_num_seqs``). A long prompt is thus prefilled over several steps, interleaved
with other sequences' decodes.

When the KV cache runs out of blocks, the most recently admitted running sequence is
preempted by recompute: its blocks are freed and it goes back to the front of the
waiting queue with every token it has generated, so when readmitted it prefills
prompt + output again and carries on exactly where it was.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.config import EngineOptions
from llmctl.engine.runner import StepBatch
from llmctl.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """The sequences of one step and how many new tokens each feeds the model."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    def to_batch(self, block_size: int) -> StepBatch:
        """Flatten into the runner's ``StepBatch``."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        context_lens: list[int] = []
        for seq, count in zip(self.seqs, self.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + count])
            for position in range(start, start + count):
                positions.append(position)
                block = seq.block_table[position // block_size]
                slot_mapping.append(block * block_size + position % block_size)
            context_lens.append(start + count)
        return StepBatch(
            input_ids=input_ids,
            positions=positions,
            query_lens=list(self.num_new_tokens),
            context_lens=context_lens,
            block_tables=[seq.block_table for seq in self.seqs],
            slot_mapping=slot_mapping,
        )


class Scheduler:
    def __init__(self, options: EngineOptions, block_manager: BlockManager) -> None:
        self.options = options
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preempt from the end
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """Pick this step's work; ``None`` when there is nothing to run."""
        step = ScheduledStep([], [])
        budget = self.options.max_num_batched_tokens
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, count):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, count)
                step.seqs.append(seq)
                step.num_new_tokens.append(count)
                budget -= count
                index += 1

        # Admitting new work right after preempting would only thrash the cache.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.options.max_num_seqs
            and self.block_manager.can_allocate(self.waiting[0])
        ):
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            step.seqs.append(seq)
            step.num_new_tokens.append(count)
            budget -= count

        return step if step.seqs else None

    def mark_computed(self, step: ScheduledStep) -> list[Sequence]:
        """Record the step's K/V as computed; return the sequences that now sample a token
        (a decode, or a prefill whose last chunk just ran)."""
        ready = []
        for seq, count in zip(step.seqs, step.num_new_tokens):
            seq.num_computed_tokens += count
            self.block_manager.cache_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(seq)
        return ready

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
