"""The host side of a step: one packed int32 buffer per step (both runners), its padding
to a CUDA-graph bucket, and the buckets themselves. Pure host code, checked on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from llmctl.engine.runner import (
    DecodeGraphs,
    GraphShape,
    StepBatch,
    StepLayout,
    batch_buckets,
    bucket_for,
    pack_step,
    replay_eagerly,
    stage_step,
)


def random_batch(rng: random.Random, num_seqs: int, decode: bool, block_size: int = 16):
    """A step with ragged query lengths (or one token each) over scattered blocks."""
    batch = StepBatch([], [], [], [], [], [])
    for _ in range(num_seqs):
        count = 1 if decode else rng.randint(1, 20)
        start = rng.randint(0, 60)
        end = start + count
        table = rng.sample(range(1000), -(-end // block_size))
        batch.input_ids += [rng.randrange(1, 500) for _ in range(count)]
        batch.positions += list(range(start, end))
        batch.query_lens.append(count)
        batch.context_lens.append(end)
        batch.block_tables.append(table)
        batch.slot_mapping += [table[p // block_size] * block_size + p % block_size
                               for p in range(start, end)]  # fmt: skip
    return batch


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("decode", [True, False])
def test_packed_step_unpacks_to_the_batch(seed, decode):
    rng = random.Random(seed)
    batch = random_batch(rng, rng.randint(1, 9), decode)
    inputs = stage_step(batch, torch.device("cpu"))
    assert inputs.input_ids.tolist() == batch.input_ids
    assert inputs.positions.tolist() == batch.positions
    assert inputs.slot_mapping.tolist() == batch.slot_mapping
    assert inputs.context_lens.tolist() == batch.context_lens
    starts = inputs.query_start_loc.tolist()
    assert [b - a for a, b in zip(starts, starts[1:])] == batch.query_lens
    width = max(map(len, batch.block_tables))
    assert inputs.block_tables.shape == (batch.num_seqs, width)
    for row, table in zip(inputs.block_tables.tolist(), batch.block_tables):
        assert row == table + [0] * (width - len(table))
    assert inputs.logits_indices is None
    assert inputs.logits_rows().tolist() == [b - 1 for b in starts[1:]]
    assert all(t.dtype == torch.int32 for t in vars(inputs).values() if t is not None)


def test_logits_indices_travel_after_the_block_tables():
    rng = random.Random(7)
    batch = random_batch(rng, 4, decode=False)
    batch.logits_indices = sorted(rng.sample(range(len(batch.input_ids)), 3))
    inputs = stage_step(batch, torch.device("cpu"))
    assert inputs.logits_indices.tolist() == batch.logits_indices
    assert inputs.logits_rows().tolist() == batch.logits_indices
    assert inputs.input_ids.tolist() == batch.input_ids


@pytest.mark.parametrize("num_seqs, bucket", [(1, 1), (3, 4), (5, 8), (17, 32), (16, 16)])
def test_a_decode_batch_pads_to_its_bucket_with_inert_rows(num_seqs, bucket):
    rng = random.Random(num_seqs)
    batch = random_batch(rng, num_seqs, decode=True)
    flat, layout = pack_step(batch, pad=GraphShape(bucket))
    assert layout == StepLayout(bucket, bucket, num_seqs, max(map(len, batch.block_tables)))
    assert len(flat) == layout.size
    inputs = layout.unpack(torch.tensor(flat, dtype=torch.int32))
    pad = bucket - num_seqs
    assert inputs.input_ids.tolist() == batch.input_ids + [0] * pad
    assert inputs.slot_mapping.tolist() == batch.slot_mapping + [-1] * pad  # writes nowhere
    assert inputs.context_lens.tolist() == batch.context_lens + [0] * pad  # reads nothing
    assert inputs.query_start_loc.tolist() == list(range(bucket + 1))
    assert inputs.block_tables.shape[0] == num_seqs  # tables travel for real rows only


def test_the_head_of_a_padded_step_sits_where_the_bucket_says():
    """A graph reads ids/positions/slots/lengths at offsets fixed by its bucket alone."""
    rng = random.Random(0)
    for num_seqs in (3, 4):
        flat, layout = pack_step(random_batch(rng, num_seqs, decode=True), pad=GraphShape(4))
        assert layout.head_size == StepLayout(4, 4, 0, 0).head_size == 3 * 4 + 2 * 4 + 1


def test_only_decode_batches_pad():
    rng = random.Random(1)
    prefill = random_batch(rng, 3, decode=False)
    prefill.query_lens[0] = 2  # make sure one sequence has several tokens
    prefill.input_ids.append(7)
    with pytest.raises(ValueError, match="only a decode batch"):
        pack_step(prefill, pad=GraphShape(4))
    with pytest.raises(ValueError, match="cannot pad"):
        pack_step(random_batch(rng, 5, decode=True), pad=GraphShape(4))


@pytest.mark.parametrize(
    "max_batch_size, expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (40, [1, 2, 4, 8, 16, 32, 40]),
        (128, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]),
        (130, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 130]),
    ],
)
def test_buckets(max_batch_size, expected):
    assert batch_buckets(max_batch_size) == expected
    for n in range(1, max_batch_size + 1):
        bucket = bucket_for(n, expected)
        assert bucket >= n and not any(n <= b < bucket for b in expected)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket_for(max_batch_size + 1, expected)


def test_graphs_take_decode_batches_up_to_the_largest_bucket():
    rng = random.Random(2)
    graphs = DecodeGraphs(
        lambda inputs: inputs.input_ids.float(),
        max_batch_size=6,
        max_blocks_per_seq=8,
        block_size=16,
        num_blocks=1000,
        device=torch.device("cpu"),
    )
    assert graphs.buckets == [1, 2, 4, 6]
    assert graphs.fits(random_batch(rng, 6, decode=True))
    assert not graphs.fits(random_batch(rng, 7, decode=True))
    mixed = random_batch(rng, 3, decode=True)
    mixed.query_lens[1] = 2
    mixed.input_ids.append(9)
    assert not graphs.fits(mixed)
    too_wide = random_batch(rng, 2, decode=True)
    too_wide.block_tables[1] = list(range(9))
    assert not graphs.fits(too_wide)


def test_replays_see_each_batch_in_the_fixed_buffers():
    """Batches of changing sizes and widths, one after another: every replay sees the
    current batch's rows (and stale data only where kernels must not look)."""
    block_size = 16

    def forward(inputs):
        blocks_used = -(-inputs.context_lens // block_size)
        in_context = torch.arange(inputs.block_tables.shape[1]) < blocks_used[:, None]
        table_sums = (inputs.block_tables * in_context).sum(1)
        fields = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.context_lens)
        return torch.stack([*fields, table_sums], dim=1)

    graphs = DecodeGraphs(
        forward,
        max_batch_size=20,
        max_blocks_per_seq=8,
        block_size=block_size,
        num_blocks=1000,
        device=torch.device("cpu"),
        record=replay_eagerly,
    )
    graphs.capture(progress=False)
    assert graphs.replays == 0
    rng = random.Random(3)
    for num_seqs in (17, 3, 20, 1, 5, 16, 2):
        batch = random_batch(rng, num_seqs, decode=True, block_size=block_size)
        out = graphs.run(batch)
        expected = [
            [i, p, s, c, sum(t)]
            for i, p, s, c, t in zip(
                batch.input_ids,
                batch.positions,
                batch.slot_mapping,
                batch.context_lens,
                batch.block_tables,
            )
        ]
        assert out.tolist() == expected
    assert graphs.replays == 7
