"""The host side of a step: one packed int32 buffer per step (both runners), its padding
to a CUDA-graph bucket, and the buckets themselves. Pure host code, checked on the CPU."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from llmctl.engine.runner import (
    DecodeGraphs,
    GraphShape,
    PagedRunner,
    SampledTokenFill,
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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("decode", [True, False])
def test_cpu_inputs_are_the_packed_inputs(seed, decode):
    """An eager CPU step skips the packing (``host_inputs``): over the engine's int32
    arrays (views, no copy) and over plain lists alike, its inputs are the unpacked ones."""
    rng = random.Random(seed)
    batch = random_batch(rng, rng.randint(1, 9), decode)
    if seed % 2:
        batch.logits_indices = sorted(rng.sample(range(len(batch.input_ids)), 2))
    flat, layout = pack_step(batch)
    packed = layout.unpack(torch.from_numpy(flat))
    as_arrays = dataclasses.replace(
        batch,
        **{
            name: np.asarray(getattr(batch, name), dtype=np.int32)
            for name in ("input_ids", "positions", "query_lens", "context_lens", "slot_mapping")
        },
        block_tables=batch.block_table_array(),
    )
    for given in (batch, as_arrays):
        inputs = stage_step(given, torch.device("cpu"))
        for name, expected in vars(packed).items():
            got = getattr(inputs, name)
            assert (got is None) == (expected is None), name
            if expected is not None:
                assert got.dtype == torch.int32 and torch.equal(got, expected), name
    assert np.shares_memory(inputs.positions.numpy(), as_arrays.positions)


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


@pytest.mark.parametrize("bucket", [None, 8])
def test_tokens_still_on_the_device_land_in_the_staged_inputs(bucket):
    """Overlapped steps: the tokens the step in flight sampled fill their places, picked
    by index, or as a steady decode's whole batch (no indices: the first ones, in order);
    padding stays as it was."""
    rng = random.Random(5)
    batch = random_batch(rng, 5, decode=True)
    pad = None if bucket is None else GraphShape(bucket)
    picked = dataclasses.replace(
        batch, sampled_tokens=SampledTokenFill(torch.tensor([1, 4]), torch.tensor([501, 502]))
    )
    inputs = stage_step(
        picked, torch.device("cpu"), pad=pad, out=torch.empty(4096, dtype=torch.int32)
    )
    expected = list(batch.input_ids)
    expected[1], expected[4] = 501, 502
    assert inputs.input_ids.tolist()[:5] == expected
    sampled = torch.tensor([rng.randrange(1, 500) for _ in range(5)])  # int64, as sampled
    whole = dataclasses.replace(batch, sampled_tokens=SampledTokenFill(None, sampled))
    inputs = stage_step(
        whole, torch.device("cpu"), pad=pad, out=torch.empty(4096, dtype=torch.int32)
    )
    assert inputs.input_ids.tolist() == sampled.tolist() + [0] * ((bucket or 5) - 5)
    assert inputs.positions.tolist()[:5] == batch.positions


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


def verification_batch(rng: random.Random, num_seqs: int, k: int, lora: bool = False):
    """A speculative step: each sequence feeds its last token and up to ``k`` proposals
    (some none: they do not speculate), logits asked at each verified position; each
    sequence's LoRA slot (-1: none) if ``lora``."""
    batch = random_batch(rng, 0, decode=True)
    for _ in range(num_seqs):
        count = rng.randint(1, k + 1)
        start = rng.randint(0, 60)
        table = rng.sample(range(1000), -(-(start + count) // 16))
        batch.input_ids += [rng.randrange(1, 500) for _ in range(count)]
        batch.positions += list(range(start, start + count))
        batch.query_lens.append(count)
        batch.context_lens.append(start + count)
        batch.block_tables.append(table)
        batch.slot_mapping += [table[p // 16] * 16 + p % 16 for p in range(start, start + count)]
    first = 0
    batch.logits_indices = []
    for count in batch.query_lens:  # every position of a proposing sequence, else its last
        batch.logits_indices += range(first if count > 1 else first + count - 1, first + count)
        first += count
    if lora:
        batch.lora_slots = [rng.randrange(-1, 4) for _ in range(num_seqs)]
    return batch


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lora", [False, True])
def test_a_verification_step_pads_to_its_graph_with_inert_padding(seed, lora):
    """Real sequences keep their tokens in place; padding sequences and tokens follow,
    writing nowhere, attending to nothing, without an adapter; the logits indices past
    the step's own name the last padding token."""
    rng = random.Random(seed)
    num_seqs, k = rng.randint(1, 8), rng.randint(1, 4)
    batch = verification_batch(rng, num_seqs, k, lora)
    shape = GraphShape(bucket_for(num_seqs, batch_buckets(8)), k + 1, lora)
    flat, layout = pack_step(batch, pad=shape)
    assert layout.head_size == shape.layout().head_size  # where the graph reads it
    inputs = layout.unpack(torch.tensor(flat, dtype=torch.int32))
    tokens, real = shape.num_tokens, len(batch.input_ids)
    assert tokens == shape.batch * (k + 1) + 1 and shape.num_seqs == shape.batch + 1
    assert inputs.input_ids.tolist() == batch.input_ids + [0] * (tokens - real)
    assert inputs.positions.tolist() == batch.positions + [0] * (tokens - real)
    assert inputs.slot_mapping.tolist() == batch.slot_mapping + [-1] * (tokens - real)
    spare_seqs = shape.num_seqs - num_seqs
    assert inputs.context_lens.tolist() == batch.context_lens + [0] * spare_seqs
    starts = inputs.query_start_loc.tolist()
    assert [b - a for a, b in zip(starts, starts[1:])][:num_seqs] == batch.query_lens
    assert starts[-1] == tokens and starts == sorted(starts)
    logits = inputs.logits_indices.tolist()
    assert len(logits) == shape.num_logits == shape.batch * (k + 1)
    own = len(batch.logits_indices)
    assert logits[:own] == batch.logits_indices and logits[own:] == [tokens - 1] * (
        shape.num_logits - own
    )
    if lora:
        want = [s for s, n in zip(batch.lora_slots, batch.query_lens) for _ in range(n)]
        assert inputs.lora_slots.tolist() == want + [-1] * (tokens - real)
    else:
        assert inputs.lora_slots is None
    assert not inputs.is_decode


def test_padding_refuses_what_would_drop_tokens_logits_or_adapters():
    rng = random.Random(4)
    batch = verification_batch(rng, 3, k=3)
    batch.query_lens[0] = 4  # make sure one sequence has k + 1 tokens
    with pytest.raises(ValueError, match="more than the graph's 3"):
        pack_step(batch, pad=GraphShape(4, 3))
    with pytest.raises(ValueError, match="only a decode batch"):
        pack_step(batch, pad=GraphShape(4))
    decode = random_batch(rng, 2, decode=True)
    decode.lora_slots = [0, -1]
    with pytest.raises(ValueError, match="LoRA slots"):
        pack_step(decode, pad=GraphShape(2))
    decode.lora_slots, decode.logits_indices = None, [0, 1]
    with pytest.raises(ValueError, match="verification graph"):
        pack_step(decode, pad=GraphShape(2))


def fields_at_logits(inputs):
    """A stand-in model: for each token whose logits the step returns, its id, position,
    slot, LoRA slot (-1 without) and its sequence's block-table sum over its context."""
    rows = inputs.logits_rows()
    seq_of_token = torch.bucketize(rows, inputs.query_start_loc[1:], right=True)
    blocks_used = -(-inputs.context_lens // 16)
    in_context = torch.arange(inputs.block_tables.shape[1]) < blocks_used[:, None]
    table_sums = (inputs.block_tables * in_context).sum(1)[seq_of_token]
    lora = inputs.lora_slots[rows] if inputs.lora_slots is not None else torch.full_like(rows, -1)
    fields = [inputs.input_ids, inputs.positions, inputs.slot_mapping]
    return torch.stack([*(f[rows] for f in fields), lora, table_sums], dim=1)


def expected_fields(batch):
    starts = [0, *np.cumsum(batch.query_lens)]
    rows = batch.logits_indices
    if rows is None:
        rows = [end - 1 for end in starts[1:]]
    seq_of = np.searchsorted(starts[1:], rows, side="right")
    slots = batch.lora_slots
    return [
        [
            batch.input_ids[r],
            batch.positions[r],
            batch.slot_mapping[r],
            -1 if slots is None else slots[s],
            sum(batch.block_tables[s]),
        ]
        for r, s in zip(rows, seq_of)
    ]


def test_replays_see_each_verification_and_adapter_step_in_the_fixed_buffers():
    """Decode and verification steps of changing sizes, with and without adapters, one
    after another through the same buffers: each replay returns what the stand-in model
    computes of the current step at exactly the positions it asked for."""
    graphs = DecodeGraphs(
        fields_at_logits,
        max_batch_size=12,
        max_blocks_per_seq=8,
        block_size=16,
        num_blocks=1000,
        device=torch.device("cpu"),
        num_speculative_tokens=3,
        record=replay_eagerly,
    )
    graphs.capture(progress=False)
    rng = random.Random(8)
    decode = random_batch(rng, 5, decode=True)
    assert graphs.shape_for(decode) == GraphShape(8, 1)
    adapted = verification_batch(rng, 3, k=3, lora=True)
    assert graphs.shape_for(adapted) is None  # no LoRA graphs yet: eager
    graphs.capture(progress=False, lora=True)
    assert graphs.shape_for(adapted) == GraphShape(4, 4, lora=True)
    too_long = verification_batch(rng, 2, k=3)
    too_long.query_lens[0] = 5
    assert graphs.shape_for(too_long) is None
    steps = [
        verification_batch(rng, 12, k=3),
        random_batch(rng, 3, decode=True),
        verification_batch(rng, 1, k=3, lora=True),
        verification_batch(rng, 7, k=2),
        adapted,
        verification_batch(rng, 12, k=3, lora=True),
    ]
    lora_decode = random_batch(rng, 9, decode=True)
    lora_decode.lora_slots = [rng.randrange(-1, 4) for _ in range(9)]
    steps.append(lora_decode)
    for batch in steps:
        assert graphs.run(batch).tolist() == expected_fields(batch)
    assert (graphs.replays, graphs.verify_replays, graphs.lora_replays) == (7, 5, 4)


class StandInRunner(PagedRunner):
    """A runner whose "model" is ``fields_at_logits``; its graphs with LoRA slots run out
    of device memory while being captured, as a big model's may mid-serving."""

    def __init__(self, config) -> None:
        super().__init__(config, block_size=16, max_num_seqs=4, max_model_len=128)
        self.lora_captures = 0

    def _allocate(self, num_blocks: int) -> None:
        pass

    def graphs_take_lora(self) -> bool:
        return True

    def forward(self, inputs, is_decode: bool):
        if inputs.lora_slots is not None:
            self.lora_captures += 1
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return fields_at_logits(inputs)


def test_lora_graphs_that_do_not_fit_leave_adapter_steps_eager(tiny_model_dir, caplog):
    from llmctl.model.config import ModelConfig

    runner = StandInRunner(ModelConfig.from_dir(tiny_model_dir("llama3-rope")))
    runner.allocate_kv_cache(100)  # no graphs on the CPU: made here, replayed eagerly
    graphs = DecodeGraphs(
        runner.decode_step, max_batch_size=4, max_blocks_per_seq=8, block_size=16,
        num_blocks=100, device=torch.device("cpu"), record=replay_eagerly,
    )  # fmt: skip
    graphs.capture(progress=False)
    runner.decode_graphs = graphs
    captured = set(graphs._replays)
    rng = random.Random(9)
    for _ in range(2):
        batch = random_batch(rng, 3, decode=True)
        batch.lora_slots = [0, -1, 1]
        with caplog.at_level("WARNING", logger="llmctl"):
            # eagerly: an eager step's inputs carry no per-token slots (the runner groups
            # its adapters' rows on the host)
            eager = dataclasses.replace(batch, lora_slots=None)
            assert runner.execute(batch).tolist() == expected_fields(eager)
    assert runner.lora_captures == 1  # tried once, not at every step
    assert "run eagerly" in caplog.text
    assert not graphs.lora_captured and set(graphs._replays) == captured
    assert graphs.replays == 0
    plain = random_batch(rng, 3, decode=True)
    assert runner.execute(plain).tolist() == expected_fields(plain)
    assert graphs.replays == 1  # the graphs without LoRA still serve the base model
