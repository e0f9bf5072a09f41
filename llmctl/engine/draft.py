"""Draft-model proposals for speculative decoding (``speculative_method=draft``).

A small model that shares the target's tokenizer writes the next few tokens greedily;
the target verifies them in one step (``llmctl.engine.speculative``). Its proposals are
its argmax, a point mass, so the verification that keeps the target's distribution
exactly is the one prompt lookup uses: greedy output is unchanged, sampled output keeps
its distribution.

The draft runs on a paged cache of its own with the same blocks as the target: its
cache has as many blocks, and a sequence's block table (and so every slot) serves both
models. The scheduler's allocation for a verification step (the last token and the
proposals) therefore covers the draft's writes too, and the target's rollback of
rejected positions needs nothing of the draft. What the draft has computed is
``seq.draft_computed`` tokens, never more than the target's (after a rollback the
draft's K/V past that point belong to rejected tokens; a preempted sequence starts
again from 0). Before proposing, the draft catches up on the tokens it lacks in one
chunk (its prefill, the first time), then decodes one token per step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from llmctl.engine.runner import PagedRunner, StepBatch
from llmctl.engine.sampler import argmax_rows
from llmctl.engine.sequence import Sequence


class DraftModel:
    """Fills the proposals of a scheduled step with the draft's greedy tokens."""

    def __init__(self, runner: PagedRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: a draft's padded vocabulary is cut

    def fill(self, seqs: Seq[Sequence], proposals: Seq[list[int]]) -> None:
        """Overwrite each proposal (placeholders, as many as the step verifies) in place
        with the draft's tokens after ``seq``'s last token."""
        drafted: list[list[int]] = [[] for _ in seqs]
        # The first call catches each sequence up: its tokens from what the draft has
        # computed to its last token (one token when the draft is up to date).
        feeds = []
        for seq in seqs:
            start = min(seq.draft_computed, seq.num_computed_tokens)
            feeds.append((seq, start, seq.token_ids[start:]))
        for j, token in enumerate(self._next_tokens(feeds)):
            drafted[j].append(token)
        for offset in range(1, max(map(len, proposals), default=0)):
            active = [j for j, proposal in enumerate(proposals) if len(proposal) > offset]
            feeds = [
                (seqs[j], len(seqs[j].token_ids) + offset - 1, [drafted[j][-1]]) for j in active
            ]
            for j, token in zip(active, self._next_tokens(feeds)):
                drafted[j].append(token)
        for seq, proposal, tokens in zip(seqs, proposals, drafted):
            proposal[:] = tokens
            # K/V written up to the last proposal but one (the target verifies that one).
            seq.draft_computed = len(seq.token_ids) + len(proposal) - 1

    def _next_tokens(self, feeds: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        """One draft step: each ``(seq, start, tokens)`` writes ``tokens`` at positions
        ``start...`` of seq's blocks; the draft's argmax after each row's last token."""
        size = self.runner.block_size
        input_ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
        for seq, start, tokens in feeds:
            table = np.asarray(seq.block_table, dtype=np.int64)
            where = np.arange(start, start + len(tokens))
            input_ids += tokens
            positions.append(where)
            slots.append(table[where // size] * size + where % size)
            query_lens.append(len(tokens))
            context_lens.append(start + len(tokens))
            tables.append(seq.block_table)
        batch = StepBatch(
            input_ids=np.asarray(input_ids, dtype=np.int32),
            positions=np.concatenate(positions).astype(np.int32),
            query_lens=np.asarray(query_lens, dtype=np.int32),
            context_lens=np.asarray(context_lens, dtype=np.int32),
            block_tables=[list(table) for table in tables],
            slot_mapping=np.concatenate(slots).astype(np.int32),
        )
        logits = self.runner.execute(batch)
        return argmax_rows(logits[:, : self.vocab_size]).tolist()
