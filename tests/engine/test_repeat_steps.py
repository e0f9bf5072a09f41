"""The steady decode step, derived from the one before (``ScheduledStep.repeats``): its
batch equals the one built from scratch, field by field, on every step, and its
bookkeeping keys each block that fills up, as the general path does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.scheduler import Scheduler, StepBatchBuilder
from tests.helpers.paged_toy_model import make_engine, run, workload

FIELDS = ("input_ids", "positions", "query_lens", "context_lens", "block_tables", "slot_mapping")


def filled_input_ids(batch) -> torch.Tensor:
    """The batch's input ids once the tokens still on the device are filled in."""
    input_ids = torch.tensor(batch.input_ids, dtype=torch.int32)
    batch.fill_sampled_tokens(input_ids)
    return input_ids


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_repeated_steps_batch_is_the_one_built_from_scratch(
    stories_tokenizer, monkeypatch, block_size, prefix_caching, overlap
):
    """With overlapped steps a repeat's tokens are the whole batch the step in flight
    sampled; built from scratch, they are gathered row by row."""
    checked = []
    build = StepBatchBuilder.build

    def checking_build(self, step, in_flight=None):
        batch = build(self, step, in_flight)
        if step.repeats is not None:
            assert bool(step.pending) == overlap
            fresh = self._build(step, in_flight)
            for name in FIELDS:
                assert np.array_equal(getattr(batch, name), getattr(fresh, name)), name
            assert torch.equal(filled_input_ids(batch), filled_input_ids(fresh))
            if overlap:
                assert -1 not in filled_input_ids(batch).tolist()
            checked.append(len(step.seqs))
        return batch

    monkeypatch.setattr(StepBatchBuilder, "build", checking_build)
    options = dict(block_size=block_size, enable_prefix_caching=prefix_caching, overlap=overlap)
    requests = [
        (f"r{i}", list(range(3 + i, 9 + 2 * i)), SamplingParams(max_tokens=30 + i, temperature=0))
        for i in range(6)
    ]
    engine = make_engine(stories_tokenizer, **options)
    for request in requests:
        engine.add_request(*request)
    while engine.has_unfinished():
        engine.step()
        if prefix_caching:  # every full block of a running sequence is keyed at once
            for seq in engine.scheduler.running:
                assert len(seq.block_hashes) == seq.num_computed_tokens // block_size
    assert len(checked) > 20  # most steps were repeats


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_outputs_are_those_of_steps_scheduled_one_by_one(
    stories_tokenizer, monkeypatch, overlap, block_size
):
    options = dict(block_size=block_size, enable_prefix_caching=True, overlap=overlap)
    repeated = run(make_engine(stories_tokenizer, **options), workload(seed=1))
    monkeypatch.setattr(Scheduler, "_repeat", lambda self: None)
    assert run(make_engine(stories_tokenizer, **options), workload(seed=1)) == repeated
