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

Most steps repeat the one before: the same sequences, one decode token each. While
nothing changes (no request added, finished or preempted) such a step is derived from
the previous one, and only the sequences that need a new block are looked at one by
one, so scheduling costs grow with what changed rather than with the batch. The step's
``StepBatch`` is built the same way (``StepBatchBuilder``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.config import EngineConfig
from llmctl.engine.held_steps import HeldSteps
from llmctl.engine.lora import NO_SLOT, LoraSlots
from llmctl.engine.runner import SampledTokenFill, StepBatch
from llmctl.engine.sampler import SampledBatch
from llmctl.engine.sequence import Sequence, SequenceStatus
from llmctl.engine.transfer import to_device


@dataclass
class ScheduledStep:
    """The sequences of one step and what each feeds the model.

    ``starts[i]`` is where ``seqs[i]``'s new tokens begin (its computed tokens when
    scheduled) and ``num_new_tokens[i]`` how many there are; ``input_ids`` is all of them
    flattened, with -1 where a token is still on the device (``pending``: its index in
    ``input_ids`` and the sequence). ``ready`` lists the rows that sample a token (a
    decode, or the last chunk of a prefill). ``proposed`` maps a row to the tokens
    speculative decoding proposed for it: they follow its token in ``input_ids`` (and in
    ``num_new_tokens``), and the step is verifying them. ``scored`` rows score their
    prompt (``prompt_logprobs``): the step returns logits at every one of their tokens.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    pending: list[tuple[int, Sequence]] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    proposed: dict[int, list[int]] = field(default_factory=dict)
    # row -> (tokens, logprobs) of a verified row, filled once its logits are in
    verified: dict[int, tuple[list[int], list]] = field(default_factory=dict)
    scored: set[int] = field(default_factory=set)
    # A step that repeats ``repeats`` one position on (the scheduler's steady decode):
    # its batch follows from that step's by array arithmetic (StepBatchBuilder._build_repeat),
    # its bookkeeping by a plain loop over the rows (mark_computed).
    repeats: ScheduledStep | None = None
    opens_blocks: bool = False  # a repeat where some sequence's token opens a block

    def add(self, seq: Sequence, count: int) -> None:
        start = seq.num_computed_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(count)
        self.starts.append(start)
        self.rows.append(seq.row)
        proposal = seq.proposal
        if proposal:  # the last token, then the proposals it verifies
            self.proposed[len(self.seqs) - 1] = proposal
            self.input_ids.append(seq.token_ids[start])
            self.input_ids += proposal
            count -= len(proposal)
        elif seq.num_pending_tokens:  # a decode of the token the step in flight samples
            self.pending.append((len(self.input_ids), seq))
            self.input_ids.append(-1)
        elif count == 1:
            self.input_ids.append(seq.token_ids[start])
        else:
            self.input_ids += seq.token_ids[start : start + count]
        if seq.scores_prompt:
            self.scored.add(len(self.seqs) - 1)
        if start + count == len(seq.token_ids) + seq.num_pending_tokens:
            self.ready.append(len(self.seqs) - 1)

    def sampled_rows(self) -> list[int]:
        """The ready rows the sampler serves (those verifying proposals are not)."""
        if not self.proposed:
            return self.ready
        return [index for index in self.ready if index not in self.proposed]


# The step the device still runs (steps overlap) and the tokens it samples.
InFlight = tuple[ScheduledStep, SampledBatch | None]


class StepBatchBuilder:
    """The runner's ``StepBatch``, built from rows that running sequences keep between
    steps: each running sequence owns a row of one block-table array, its table copied
    there when it is admitted and afterwards only the blocks it gains written; a step's
    arrays (positions, slots, context lengths, its rows of block tables) then come from
    numpy over the step's rows, with no Python work per token."""

    def __init__(self, block_size: int, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self._table_lens = [0] * max_num_seqs  # entries of each row already written
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.lora_slots = np.full(max_num_seqs, NO_SLOT, dtype=np.int32)  # each row's adapter
        self._num_lora_rows = 0
        self._built: tuple[ScheduledStep, StepBatch] | None = None  # the last step's

    def admit(self, seq: Sequence) -> None:
        """Give a sequence that starts running a row, with its block table."""
        seq.row = self._free_rows.pop()
        self._table_lens[seq.row] = 0
        self.sync_table(seq)
        if seq.lora_slot != NO_SLOT:
            self.lora_slots[seq.row] = seq.lora_slot
            self._num_lora_rows += 1

    def release(self, seq: Sequence) -> None:
        if self.lora_slots[seq.row] != NO_SLOT:
            self.lora_slots[seq.row] = NO_SLOT
            self._num_lora_rows -= 1
        self._free_rows.append(seq.row)
        seq.row = None

    def sync_table(self, seq: Sequence) -> None:
        """Write the blocks ``seq`` gained since its row was last written."""
        row, table = seq.row, seq.block_table
        known = self._table_lens[row]
        if len(table) > known:
            self.block_tables[row, known : len(table)] = table[known:]
            self._table_lens[row] = len(table)

    def truncate_table(self, seq: Sequence) -> None:
        """``seq`` lost blocks at the end of its table: rewrite from there when it gains."""
        self._table_lens[seq.row] = min(self._table_lens[seq.row], len(seq.block_table))

    def build(self, step: ScheduledStep, in_flight: InFlight | None = None) -> StepBatch:
        """``in_flight``: the step the device still runs and its sampled batch (steps
        overlap), where ``step``'s pending input tokens are."""
        built = self._built
        if built is not None and step.repeats is built[0]:
            batch = self._build_repeat(step, built[1], in_flight)
        else:
            batch = self._build(step, in_flight)
        self._built = (step, batch)
        return batch

    def _build_repeat(
        self, step: ScheduledStep, before: StepBatch, in_flight: InFlight | None
    ) -> StepBatch:
        """The batch of the step before, every sequence one token on: only a sequence
        whose token opens a block changes its table (and then the step's tables are
        taken again); every other slot is the next one of its block."""
        size = self.block_size
        positions = before.positions + 1
        context_lens = before.context_lens + 1
        if step.opens_blocks:
            rows = np.array(step.rows, dtype=np.intp)
            width = int(context_lens.max() + size - 1) // size
            block_tables = self.block_tables[rows, :width]
            slots = self.block_tables[rows, positions // size] * size + positions % size
        else:
            block_tables, slots = before.block_tables, before.slot_mapping + 1
        return StepBatch(
            input_ids=np.array(step.input_ids, dtype=np.int32),
            positions=positions,
            query_lens=before.query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=slots,
            # Steps overlap: the step it repeats is the one in flight, and sampled a token
            # for every row, in order; that whole batch is this step's input.
            sampled_tokens=SampledTokenFill(None, in_flight[1].token_ids) if step.pending else None,
            lora_slots=before.lora_slots,
        )

    def _build(self, step: ScheduledStep, in_flight: InFlight | None) -> StepBatch:
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
        logits_indices = None
        if step.proposed or step.scored:  # logits at each last token and at every
            # proposal (verified) or every new token (a prompt scored) of those rows
            last = np.cumsum(counts) - 1
            logits_per_row = np.ones(len(counts), dtype=np.int64)
            for index, proposal in step.proposed.items():
                logits_per_row[index] += len(proposal)
            for index in step.scored:
                logits_per_row[index] = counts[index]
            logits_indices = np.repeat(last + 1 - logits_per_row, logits_per_row) + (
                np.arange(int(logits_per_row.sum()))
                - np.repeat(np.cumsum(logits_per_row) - logits_per_row, logits_per_row)
            )
        return StepBatch(
            input_ids=np.array(step.input_ids, dtype=np.int32),
            positions=positions,
            query_lens=counts,
            context_lens=context_lens,
            block_tables=self.block_tables[rows, :width],
            slot_mapping=slots.astype(np.int32),
            sampled_tokens=_sampled_token_fill(step.pending, in_flight),
            logits_indices=logits_indices,
            lora_slots=self.lora_slots[rows] if self._num_lora_rows else None,
        )


def _sampled_token_fill(
    pending: list[tuple[int, Sequence]], in_flight: InFlight | None
) -> SampledTokenFill | None:
    """Where the input tokens still on the device come from: all of them were sampled by
    the one step in flight, so they are rows of its ``token_ids`` (one per row it
    sampled, in order)."""
    if not pending:
        return None
    flight, sampled = in_flight
    row_of = {flight.seqs[index]: row for row, index in enumerate(flight.sampled_rows())}
    source = sampled.token_ids
    indices = to_device([index for index, _ in pending], torch.int64, source.device)
    rows = to_device([row_of[seq] for _, seq in pending], torch.int64, source.device)
    return SampledTokenFill(token_indices=indices, token_ids=source[rows])


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_blocks_per_seq: int,
        held: HeldSteps,
        loras: LoraSlots | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.loras = loras  # a sequence runs only with its adapter in a slot
        self.batches = StepBatchBuilder(
            block_manager.block_size, config.max_num_seqs, max_blocks_per_seq
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preempt from the end
        self.num_preemptions = 0
        # The last step, when it was one decode token for every running sequence, and
        # how many more steps may repeat it before a request nears its max_tokens.
        self._repeatable: ScheduledStep | None = None
        self._repeats_left = 0
        self._opens_in = 0  # repeats until the next one where a sequence opens a block
        # The tokens a repeatable step sampled, in its order, once on the host: the next
        # repeat feeds them (``tokens_sampled``) instead of reading each sequence's last.
        self._sampled: tuple[ScheduledStep, list[int]] | None = None
        # The repeats' held tokens, while the engine keeps them by step (HeldSteps): a
        # sequence is synced with them before anything here reads it.
        self.held = held

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._repeatable = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """Pick this step's work; ``None`` when there is nothing to run.

        A running sequence's next token may still be on the device (steps overlap):
        it counts as known, and the step reads it there. One that will have all its
        tokens once that token arrives waits for it instead of running."""
        step = self._repeat() if self._repeatable is not None else None
        if step is None:
            step = self._schedule_each()
            self._remember_if_repeatable(step)
        return step

    def _schedule_each(self) -> ScheduledStep | None:
        self.held.end()
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        block_manager, batches = self.block_manager, self.batches
        block_size = block_manager.block_size
        preempted = False

        index = 0
        running = self.running
        while index < len(running) and budget > 0:
            seq = running[index]
            start = seq.num_computed_tokens
            count = min(len(seq.token_ids) + seq.num_pending_tokens - start, budget)
            if seq.proposal:  # verify as many of them as the step's budget leaves room for
                del seq.proposal[max(0, budget - count) :]
                if not block_manager.can_append(seq, count + len(seq.proposal)):
                    seq.proposal.clear()  # proposals never preempt another request
                count += len(seq.proposal)
            if seq.num_pending_tokens and seq.num_output_tokens + 1 >= seq.sampling.max_tokens:
                index += 1  # its last token is on the way
                continue
            if start + count > len(seq.block_table) * block_size:  # needs another block
                while not block_manager.can_append(seq, count):
                    victim = running.pop()  # the most recently admitted
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                else:
                    block_manager.append_slots(seq, count)
                    batches.sync_table(seq)
                if seq.row is None:  # it was the victim
                    continue
            step.add(seq, count)
            budget -= count
            index += 1

        # Admitting new work right after preempting would only thrash the cache.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(running) < self.config.max_num_seqs
            and block_manager.can_allocate(self.waiting[0])
            and (self.waiting[0].lora is None or self.loras.can_run(self.waiting[0].lora))
        ):
            seq = self.waiting.popleft()
            block_manager.allocate(seq)
            if seq.lora is not None:
                self.loras.start(seq)
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            batches.admit(seq)
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            step.add(seq, count)
            budget -= count

        return step if step.seqs else None

    def _remember_if_repeatable(self, step: ScheduledStep | None) -> None:
        self._repeatable = None
        if (
            step is None
            or len(step.seqs) != len(self.running)
            or len(step.input_ids) != len(step.seqs)
            or len(step.ready) != len(step.seqs)
            or (self.waiting and len(self.running) < self.config.max_num_seqs)
        ):
            return
        self._repeatable = step
        size = self.block_manager.block_size
        self._opens_in = min(size - start % size for start in step.starts)
        # Overlapped steps hold a sequence back when its last token is on the way.
        self._repeats_left = (
            min(
                seq.sampling.max_tokens - seq.num_output_tokens - seq.num_pending_tokens
                for seq in step.seqs
            )
            - 1
        )

    def _repeat(self) -> ScheduledStep | None:
        """The last step again, one position on; ``None`` if it cannot be (a sequence
        needs a block that is not free, or one is near its max_tokens)."""
        previous = self._repeatable
        if self._repeats_left <= 0:
            return None
        seqs = previous.seqs
        # Plain Python over the rows: right after a model call, each numpy call on arrays
        # this small costs more than a list comprehension does.
        starts = list(map((1).__add__, previous.starts))
        opening = []
        self._opens_in -= 1
        if not self._opens_in:  # some sequence's token opens a block
            size = self.block_manager.block_size
            opening = [i for i, start in enumerate(starts) if not start % size]
            self._opens_in = min(size - start % size for start in starts)
            self.held.sync(opening)
        for index in opening:
            seq = seqs[index]  # its next token opens a block
            if not self.block_manager.can_append(seq, 1):
                return None  # preemption: the full path decides
            self.block_manager.append_slots(seq, 1)
            self.batches.sync_table(seq)
        self._repeats_left -= 1
        step = ScheduledStep(
            seqs=seqs,
            num_new_tokens=previous.num_new_tokens,
            starts=starts,
            rows=previous.rows,
            ready=previous.ready,
            repeats=previous,
            opens_blocks=bool(opening),
        )
        sampled = self._sampled
        if seqs[0].num_pending_tokens:  # all are: the step in flight samples them
            if len(previous.pending) == len(seqs):  # the same placeholders as before it
                step.input_ids, step.pending = previous.input_ids, previous.pending
            else:
                step.input_ids = [-1] * len(seqs)
                step.pending = list(enumerate(seqs))
        elif sampled is not None and sampled[0] is previous:
            step.input_ids = sampled[1]
        else:
            step.input_ids = [seq.token_ids[-1] for seq in seqs]
        self._repeatable = step
        return step

    def tokens_sampled(self, step: ScheduledStep, token_ids: list[int]) -> None:
        """``step``'s sampled tokens reached the host and were appended (one per row, in
        order). Kept only while ``step`` may repeat: a sequence that finished or changed
        ends that."""
        if step is self._repeatable:
            self._sampled = (step, token_ids)

    def may_repeat(self, step: ScheduledStep) -> bool:
        """Whether the step after ``step`` may repeat it (overlapped steps: repeats it, as
        it is scheduled already)."""
        latest = self._repeatable
        return latest is not None and (step is latest or step is latest.repeats)

    def forget_repeatable(self) -> None:
        """The next step is not a repeat of the last (sequences propose tokens)."""
        self._repeatable = None

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Forget the K/V past ``num_computed`` tokens (a speculative step's rejected
        positions): the blocks beyond those seq's tokens need go back to the pool."""
        self.block_manager.truncate(seq, num_computed)
        self.batches.truncate_table(seq)

    def mark_computed(self, step: ScheduledStep) -> None:
        """Record the step's K/V as computed (the device computes it in order, before any
        later step reads it) and key the blocks that became full."""
        if self.held.marks_computed and self.held.covers(step):
            return  # marked as its rows are synced
        caching = self.block_manager.enable_prefix_caching
        size = self.block_manager.block_size
        # A repeat feeds one token each, and the blocks before it are keyed (one whose
        # last token was on the device at its mark is keyed by LLMEngine._process).
        if step.repeats is not None:
            for seq, start in zip(step.seqs, step.starts):
                seq.num_computed_tokens = computed = start + 1
                if caching and not computed % size:
                    self.block_manager.cache_full_blocks(seq)
            return
        for seq, start, count in zip(step.seqs, step.starts, step.num_new_tokens):
            seq.num_computed_tokens = start + count
            if caching and (start + count) // size > len(seq.block_hashes):
                self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` (finished or aborted) and free its blocks."""
        self.held.end()
        self._repeatable = None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.batches.release(seq)
            if seq.lora is not None:
                self.loras.stop(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.held.end()
        self._repeatable = None
        seq.proposal = []
        seq.draft_computed = 0  # its blocks go: when it runs again, the draft starts over
        self.block_manager.free(seq)
        self.batches.release(seq)
        if seq.lora is not None:
            self.loras.stop(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
