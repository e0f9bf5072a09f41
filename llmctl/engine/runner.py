"""The interface between the shared engine (scheduler, block manager, sampler) and a backend.

A backend plugs its model into the shared engine by implementing ``ModelRunner``: the
engine schedules, the runner runs one forward step over a flattened batch. This module
holds what every runner shares, in the order a step meets it:

- ``StepBatch``: one scheduler step as the runners see it (flattened new tokens,
  positions, block tables, slots);
- ``stage_step``: how a runner turns it into device tensors: every input packed into one
  int32 buffer and copied to the device once (``StepLayout`` says where each input sits,
  the same offsets for a step padded to a graph's shape, as CUDA graphs need); an eager
  CPU step takes the batch's own arrays instead (``host_inputs``);
- ``DecodeGraphs``: CUDA graphs of the decode and verification steps (below);
- ``PagedRunner``: dtype, device, KV-cache sizing and the checks around allocating it,
  and the choice of each step's path: a step that fits a captured CUDA graph replays
  it, any other step runs the runner's ``forward`` eagerly over the staged inputs.

CUDA graphs of the decode step, shared by both local runners (torch and turbo). A
decode step of a small model on a big GPU is short on the device and long on the
host: Python and the launch of a few hundred kernels, layer by layer. A CUDA graph
records those launches once and replays them with one call. A graph is fixed (its
shapes, its buffers, every kernel argument), so:

- one graph per ``GraphShape``: per batch-size bucket (``batch_buckets``: 1, 2, 4, 8,
  16, then every 16 up to ``max_batch_size``), a decode graph (one token per sequence)
  and, when the engine speculates with k = ``num_speculative_tokens``, a verification
  graph (up to k + 1 tokens per sequence: its last token and its proposals; sequences
  that do not speculate, or propose fewer, fit too); a step is padded to the smallest
  bucket that holds it. Once the runner holds LoRA adapters each has a twin with
  per-token adapter slots (captured at the first step with an adapter, for runners
  whose ``forward`` reads them: ``PagedRunner.graphs_take_lora``); the adapters'
  weights sit in fixed slot buffers, so swapping adapters keeps the graphs valid;
- the step's inputs are staged into fixed device buffers: ONE host-to-device copy of the
  packed inputs (``stage_step``) into ``staging``, whose head (ids, positions, slots,
  LoRA slots, context lengths, query starts, logits indices) the graph reads in place,
  then one device copy of the block tables into a fixed ``[sequences,
  max_blocks_per_seq]`` table;
- whatever a kernel plans on the host (the Triton decode kernel's split-K plan, its
  scratch buffers for partial results, the prefill kernel's grid) is decided from those
  fixed shapes at capture time: the table is as wide as the longest session, so the
  plan covers any context;
- nothing inside the captured region may synchronise with the host, allocate on the
  host or read a device value (``.item()``, ``.tolist()``), nor group tokens on the
  host (a LoRA step's rows by slot): what varies from step to step is data in the
  fixed buffers.

How a runner uses it (``forward`` maps ``StepInputs`` to logits)::

    graphs = decode_graphs(forward, enabled=..., device=..., max_batch_size=...,
                           max_blocks_per_seq=..., block_size=..., num_blocks=...,
                           num_speculative_tokens=k)
    # None on the CPU or when disabled; otherwise captured already.
    if graphs is not None and graphs.fits(batch):
        return graphs.run(batch)        # the eager step's logits, valid until next run
    return forward(stage_step(batch, device))   # eager: prefill, mixed, too large

Padding sequences and tokens come after the real ones (which keep their places, so
attention over them is the eager step's): padding writes nowhere (slot -1: a kernel
must skip negative slots), attends to nothing (context length 0: a decode kernel
outputs 0, no NaN; no op of a step mixes rows, so what a padding row computes is never
seen) and has no adapter (LoRA slot -1). A verification graph asks for logits at a fixed count
of tokens; those past the step's own are the padding's, never returned. Block-table
rows past the batch and entries past a sequence's last block hold stale but valid
block ids: kernels must read only the entries below ``ceil(context_len / block_size)``.

``forward`` must be capturable: called once eagerly per graph first (Triton compiles
and autotunes then, on inputs as long as the longest session, so the tuning is for
real work), then captured. All graphs share one memory pool, captured largest first
so the smaller ones reuse its memory, and write their logits into one buffer (the
largest's output: a graph's own would hold ``batch x vocab`` floats each).
"""

from __future__ import annotations

import bisect
import logging
import math
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import numpy as np
import torch

from llmctl.engine.quant import kv_cache_torch_dtype
from llmctl.engine.sampler import argmax_rows
from llmctl.model.config import ModelConfig

logger = logging.getLogger("llmctl")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A step's integers: a list, or (as the engine builds them) a 1-D int32 numpy array.
IntArray = list[int] | np.ndarray


@dataclass
class SampledTokenFill:
    """Input tokens of a step that the step before sampled and the host has not seen yet
    (steps overlap on the GPU): ``token_ids[i]`` goes to ``input_ids[token_indices[i]]``,
    or with no indices to ``input_ids[i]`` (a steady decode: every input token, in the
    order they were sampled). The tensors are on the device."""

    token_indices: torch.Tensor | None
    token_ids: torch.Tensor


@dataclass
class StepBatch:
    """One scheduler step: the new tokens of every scheduled sequence, flattened.

    Sequence ``i`` contributes ``query_lens[i]`` new tokens (a prefill chunk, or 1 for
    decode). Its KV cache holds ``context_lens[i]`` tokens once this step has written
    the new ones, so its new tokens sit at positions
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``.
    ``slot_mapping[t]`` is the physical cache slot (``block * block_size + offset``)
    where new token ``t`` writes its K/V. ``block_tables`` is one list per sequence, or
    (as the engine builds it) a 2-D int32 array padded with 0; ``block_table_array()``
    gives the padded form either way.

    When ``sampled_tokens`` is set, some ``input_ids`` are placeholders: a runner calls
    ``fill_sampled_tokens`` on its device copy of the input ids before the model runs.

    ``logits_indices`` are the new tokens (indices into ``input_ids``) whose logits the
    runner returns, in that order; ``None``: the last new token of each sequence. A
    speculative step sets it to verify every proposed position in one pass.

    ``lora_slots[i]`` is the LoRA adapter slot sequence ``i`` runs with (-1: the base
    model alone); ``None`` when no sequence of the step uses an adapter.
    """

    input_ids: IntArray
    positions: IntArray
    query_lens: IntArray
    context_lens: IntArray
    block_tables: list[list[int]] | np.ndarray
    slot_mapping: IntArray
    sampled_tokens: SampledTokenFill | None = None
    logits_indices: IntArray | None = None
    lora_slots: IntArray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one new token."""
        return len(self.input_ids) == len(self.query_lens)

    def block_table_array(self) -> np.ndarray:
        """``[num_seqs, longest table]`` int32, padded with 0 (never read)."""
        if isinstance(self.block_tables, np.ndarray):
            return self.block_tables
        width = max(map(len, self.block_tables), default=0)
        padded = np.zeros((len(self.block_tables), width), dtype=np.int32)
        for row, table in enumerate(self.block_tables):
            padded[row, : len(table)] = table
        return padded

    def fill_sampled_tokens(self, input_ids: torch.Tensor) -> None:
        """Write the tokens still on the device into ``input_ids`` (the runner's copy)."""
        fill = self.sampled_tokens
        if fill is None:
            return
        if fill.token_indices is None:  # a copy: cheaper than indexing, on either device
            input_ids[: len(fill.token_ids)].copy_(fill.token_ids)
        else:
            input_ids[fill.token_indices] = fill.token_ids.to(input_ids.dtype)


@dataclass(frozen=True)
class StepInputs:
    """A step's inputs as int32 tensors: views of one packed buffer (see ``StepLayout``)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]: -1 for padding, which writes nothing
    context_lens: torch.Tensor  # [num_seqs]: 0 for padding, which attends to nothing
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    block_tables: torch.Tensor  # [table_rows, table_width]; rows padded with block 0
    # [num_logits]: the tokens whose logits the runner returns; None: each sequence's last
    logits_indices: torch.Tensor | None = None
    # [num_tokens]: each token's LoRA slot (-1: none), in a graph's inputs only (an eager
    # step's adapters come from ``StepBatch.lora_slots``, grouped on the host)
    lora_slots: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (a graph's shapes say it: ``GraphShape``)."""
        return self.input_ids.shape[0] == self.context_lens.shape[0]

    def logits_rows(self) -> torch.Tensor:
        """Indices of the tokens whose logits the step returns."""
        if self.logits_indices is not None:
            return self.logits_indices
        return self.query_start_loc[1:] - 1


@dataclass(frozen=True)
class StepLayout:
    """Where each input sits in a step's packed int32 buffer, in this order:
    ``input_ids``, ``positions``, ``slot_mapping`` (``num_tokens`` each), ``num_lora``
    per-token LoRA slots (a graph's with adapters: ``num_tokens``; else none),
    ``context_lens`` (``num_seqs``), ``query_start_loc`` (``num_seqs + 1``),
    ``num_logits`` logits indices (a speculative step's, a verification graph's; none
    otherwise), then the block tables (``table_rows`` x ``table_width``). The part before
    the tables (the head) depends only on those counts, so a step padded to a graph's
    shape always finds it at the same offsets (what CUDA graphs need)."""

    num_tokens: int
    num_seqs: int
    table_rows: int
    table_width: int
    num_logits: int = 0
    num_lora: int = 0

    @property
    def head_size(self) -> int:
        """Entries before the block tables."""
        return 3 * self.num_tokens + self.num_lora + 2 * self.num_seqs + 1 + self.num_logits

    @property
    def size(self) -> int:
        return self.head_size + self.table_rows * self.table_width

    def unpack(self, packed: torch.Tensor) -> StepInputs:
        """Views of ``packed`` (at least ``size`` entries) as the step's inputs."""
        tokens, seqs = self.num_tokens, self.num_seqs
        table_size = self.table_rows * self.table_width
        ids, positions, slots, lora, context_lens, starts, logits, tables = packed[
            : self.size
        ].split(
            [tokens, tokens, tokens, self.num_lora, seqs, seqs + 1, self.num_logits, table_size]
        )
        return StepInputs(
            ids,
            positions,
            slots,
            context_lens,
            starts,
            tables.view(self.table_rows, self.table_width),
            logits if self.num_logits else None,
            lora if self.num_lora else None,
        )


@dataclass(frozen=True)
class GraphShape:
    """The fixed shape of one captured graph: a bucket of ``batch`` sequences feeding up
    to ``query_len`` new tokens each (1: a decode step; k + 1: a verification step of k
    proposals, ``num_speculative_tokens``), with per-token LoRA slots or without.

    A decode graph holds ``batch`` tokens of ``batch`` sequences. A verification graph
    holds ``batch * query_len + 1`` tokens of ``batch + 1`` sequences and returns the
    logits of ``batch * query_len`` tokens: every token a step of ``batch`` sequences of
    up to ``query_len`` tokens can ask for. The spare sequence and token mean padding
    always has a sequence to sit in (so the real sequences keep their tokens where the
    step put them, and attention over them is the eager step's exactly), and that the
    token count never equals the sequence count (a runner tells decode from shapes)."""

    batch: int
    query_len: int = 1
    lora: bool = False

    @property
    def num_tokens(self) -> int:
        return self.batch if self.query_len == 1 else self.batch * self.query_len + 1

    @property
    def num_seqs(self) -> int:
        return self.batch if self.query_len == 1 else self.batch + 1

    @property
    def num_logits(self) -> int:
        return 0 if self.query_len == 1 else self.batch * self.query_len

    def layout(self, table_rows: int = 0, table_width: int = 0) -> StepLayout:
        lora = self.num_tokens if self.lora else 0
        return StepLayout(
            self.num_tokens, self.num_seqs, table_rows, table_width, self.num_logits, lora
        )


def pack_step(batch: StepBatch, pad: GraphShape | None = None) -> tuple[np.ndarray, StepLayout]:
    """The step's inputs as one flat int32 array, laid out as ``StepLayout`` says.

    ``pad`` pads the step to a graph's shape (``GraphShape``): the real sequences keep
    their tokens, in place; padding sequences follow, and padding tokens after the real
    ones, shared among them (one each in a decode graph). Padding feeds token 0 at
    position 0, writes nowhere (slot -1), attends to nothing (context length 0) and runs
    without an adapter (slot -1); a verification graph's logits indices past the step's
    own name its last padding token. Block tables are sent for the real sequences only,
    each padded with block 0 to the longest (entries past a sequence's context are never
    read).
    """
    num_seqs, num_tokens = batch.num_seqs, len(batch.input_ids)
    query_lens = np.asarray(batch.query_lens, dtype=np.int64)
    logits = None if batch.logits_indices is None else np.asarray(batch.logits_indices)
    token_lora: np.ndarray | None = None
    tables = batch.block_table_array()
    if pad is None:
        seqs, tokens, pad_lens = num_seqs, num_tokens, np.zeros(0, dtype=np.int64)
        if logits is None:
            logits = np.zeros(0, dtype=np.int64)
    else:
        _check_fits(batch, pad)
        seqs, tokens = pad.num_seqs, pad.num_tokens
        spare_seqs, spare_tokens = seqs - num_seqs, tokens - num_tokens
        pad_lens = np.full(spare_seqs, spare_tokens // max(spare_seqs, 1), dtype=np.int64)
        if spare_seqs:
            pad_lens[-1] += spare_tokens % spare_seqs
        if pad.num_logits:
            if logits is None:  # each sequence's last token
                logits = np.cumsum(query_lens) - 1
            logits = np.concatenate([logits, np.full(pad.num_logits - len(logits), tokens - 1)])
        else:
            logits = np.zeros(0, dtype=np.int64)
        if pad.lora:
            token_lora = np.full(tokens, -1, dtype=np.int64)
            if batch.lora_slots is not None:
                token_lora[:num_tokens] = np.repeat(batch.lora_slots, query_lens)
    spare = tokens - num_tokens
    query_start_loc = np.zeros(seqs + 1, dtype=np.int64)
    np.cumsum(np.concatenate([query_lens, pad_lens]), out=query_start_loc[1:])
    zeros = np.zeros(spare, dtype=np.int64)
    flat = np.concatenate(
        [
            batch.input_ids,
            zeros,
            batch.positions,
            zeros,
            batch.slot_mapping,
            np.full(spare, -1),
            np.zeros(0) if token_lora is None else token_lora,
            batch.context_lens,
            np.zeros(seqs - num_seqs, dtype=np.int64),
            query_start_loc,
            logits,
            tables.reshape(-1),
        ]
    ).astype(np.int32)
    layout = StepLayout(
        tokens, seqs, *tables.shape, len(logits), 0 if token_lora is None else tokens
    )
    return flat, layout


def _check_fits(batch: StepBatch, shape: GraphShape) -> None:
    """Refuse a step that does not fit ``shape`` (``DecodeGraphs.shape_for`` picks one that
    does): padding must never drop a token, a logit or an adapter."""
    if batch.num_seqs > shape.batch:
        raise ValueError(f"cannot pad a batch of {batch.num_seqs} sequences to {shape.batch}")
    if shape.query_len == 1 and not batch.is_decode:
        raise ValueError("only a decode batch (one token per sequence) pads to a decode graph")
    if shape.query_len == 1 and batch.logits_indices is not None:
        raise ValueError("a batch with logits_indices pads only to a verification graph")
    longest = int(np.max(batch.query_lens, initial=0))
    if longest > shape.query_len:
        raise ValueError(
            f"a sequence feeds {longest} tokens, more than the graph's {shape.query_len}"
        )
    if batch.lora_slots is not None and not shape.lora:
        raise ValueError("a batch with LoRA adapters pads only to a graph with LoRA slots")


def stage_step(
    batch: StepBatch,
    device: torch.device,
    *,
    pad: GraphShape | None = None,
    out: torch.Tensor | None = None,
) -> StepInputs:
    """The step's inputs on ``device`` with ONE host-to-device copy (see ``pack_step``;
    ``pad``: padded to a graph's shape), or with none on the CPU (``host_inputs``).

    On CUDA the packed buffer is pinned and copied without blocking the host. ``out``
    (int32, on ``device``, at least ``StepLayout.size`` entries) is where the copy lands;
    by default a new tensor. Per-step Python work matters at a few hundred microseconds a
    step, so a device step makes one tensor, not one per input.
    """
    if device.type == "cpu" and pad is None and out is None:
        return host_inputs(batch)
    flat, layout = pack_step(batch, pad)
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        # Pinned (from torch's caching host allocator, which keeps the block until the
        # copy is done), so the copy is asynchronous.
        host = host.pin_memory()
    if out is None:
        packed = host.to(device, non_blocking=True)
    else:
        packed = out[: layout.size]
        packed.copy_(host, non_blocking=True)
    inputs = layout.unpack(packed)
    batch.fill_sampled_tokens(inputs.input_ids)  # tokens the previous step left on the device
    return inputs


def host_inputs(batch: StepBatch) -> StepInputs:
    """An eager CPU step's inputs: int32 tensors over the batch's own arrays where they
    are int32 already (the engine's are), so nothing is packed or copied. Right after a
    model call each numpy or torch call here runs with cold caches, at several
    microseconds: packing and unpacking cost a CPU step about 80 of them."""

    def tensor(values: IntArray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))

    num_seqs = batch.num_seqs
    if batch.is_decode:  # starts 0 .. n: arange is about 8 µs a step cheaper than cumsum
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
    else:
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(batch.query_lens, out=query_start_loc[1:])
    logits = batch.logits_indices
    inputs = StepInputs(
        tensor(batch.input_ids),
        tensor(batch.positions),
        tensor(batch.slot_mapping),
        tensor(batch.context_lens),
        torch.from_numpy(query_start_loc),
        tensor(batch.block_table_array()),
        None if logits is None else tensor(logits),
    )
    batch.fill_sampled_tokens(inputs.input_ids)
    return inputs


DecodeForward = Callable[[StepInputs], torch.Tensor]
# Records ``fn`` (reading and writing only fixed buffers) for replay: returns the replay
# function and the output tensor each replay rewrites. ``record_cuda_graph`` on a GPU.
Recorder = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]

SMALL_BUCKETS = (1, 2, 4, 8, 16)
BUCKET_STEP = 16


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, then every 16 up to ``max_batch_size``,
    which is always the last (every batch the scheduler makes fits one)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    sizes = [b for b in SMALL_BUCKETS if b < max_batch_size]
    sizes += range(2 * BUCKET_STEP, max_batch_size, BUCKET_STEP)
    return [*sizes, max_batch_size]


def bucket_for(num_seqs: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``num_seqs`` sequences."""
    index = bisect.bisect_left(buckets, num_seqs)
    if index == len(buckets):
        raise ValueError(f"a batch of {num_seqs} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def record_cuda_graph(
    fn: Callable[[], torch.Tensor], pool: object
) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture ``fn`` into a CUDA graph using the memory ``pool``. Only this thread's
    calls are checked: graphs with LoRA slots are captured while serving, when another
    thread may be pinning an adapter's host memory (``LoraRunner.read_lora``)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = fn()
    return graph.replay, output


def replay_eagerly(
    fn: Callable[[], torch.Tensor], pool: object
) -> tuple[Callable[[], None], torch.Tensor]:
    """What ``record_cuda_graph`` does, minus the graph, for checks on a machine without
    a GPU: replaying reruns ``fn`` on the same fixed buffers and writes into the same
    output tensor, so the staging and padding around the graphs run as they would."""
    output = fn()
    return (lambda: output.copy_(fn())), output


class DecodeGraphs:
    """The decode steps of one runner, captured per ``GraphShape``: every batch-size
    bucket, for plain decode (one token per sequence) and, with ``num_speculative_tokens``
    k > 0, for verification steps (up to k + 1 tokens per sequence: the last token and
    the proposals); once the runner holds LoRA adapters, each again with per-token
    adapter slots (``capture(lora=True)``, on the first step with an adapter).

    ``forward(inputs) -> logits`` is the runner's step (see the module docstring): fp32
    logits ``[batch, vocab]`` of a decode graph's inputs, ``[num_logits, vocab]`` of a
    verification graph's (``inputs.is_decode`` tells which). ``max_blocks_per_seq`` is
    the block-table width of the longest session; ``block_size`` and ``num_blocks``
    describe the allocated KV cache (the warm-up reads it, and writes nothing).
    ``record`` is ``record_cuda_graph``; ``replay_eagerly`` lets the staging and padding
    be checked on a machine without a GPU.
    """

    def __init__(
        self,
        forward: DecodeForward,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        num_speculative_tokens: int = 0,
        record: Recorder = record_cuda_graph,
    ) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.forward = forward
        self.buckets = batch_buckets(max_batch_size)
        # Tokens per sequence of each kind of graph: decode, then verification.
        self.query_lens = [1] + ([num_speculative_tokens + 1] if num_speculative_tokens else [])
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.record = record
        largest = [GraphShape(self.buckets[-1], q, lora=True) for q in self.query_lens]
        # Where stage_step's one copy lands; each graph reads its head in place.
        staging_size = max(s.layout(s.num_seqs, max_blocks_per_seq).size for s in largest)
        self.staging = torch.zeros(staging_size, dtype=torch.int32, device=self.device)
        self.block_tables = torch.zeros(
            (max(s.num_seqs for s in largest), max_blocks_per_seq),
            dtype=torch.int32,
            device=self.device,
        )
        self._replays: dict[GraphShape, Callable[[], None]] = {}
        self._outputs: dict[GraphShape, torch.Tensor] = {}
        # The logits buffer every graph writes into (the first captured's output): one
        # buffer of the most rows any graph returns, not one per graph (a verification
        # graph's holds k + 1 rows per sequence, and vocabularies are large).
        self._logits: torch.Tensor | None = None
        self._pool: object = None
        self.lora_captured = False
        self.memory_bytes = 0
        # Steps served by a graph (tests and benchmarks count them): all of them, those
        # that verified proposals, those with an adapter.
        self.replays = 0
        self.verify_replays = 0
        self.lora_replays = 0

    def shape_for(self, batch: StepBatch) -> GraphShape | None:
        """The captured graph that can take this batch, or ``None`` (it runs eagerly): a
        decode step, or with verification graphs any step whose sequences feed at most
        k + 1 tokens each, within the largest bucket, with block tables that fit the
        captured width (the scheduler's session length guarantees it), and with adapters
        only once graphs with LoRA slots are captured."""
        lora = batch.lora_slots is not None
        if (
            batch.num_seqs > self.buckets[-1]
            or (lora and not self.lora_captured)
            or batch.block_table_array().shape[1] > self.max_blocks_per_seq
        ):
            return None
        if batch.is_decode and batch.logits_indices is None:
            query_len = 1
        elif len(self.query_lens) > 1 and np.max(batch.query_lens) <= self.query_lens[-1]:
            query_len = self.query_lens[-1]
        else:
            return None
        return GraphShape(bucket_for(batch.num_seqs, self.buckets), query_len, lora)

    def fits(self, batch: StepBatch) -> bool:
        """Whether ``run`` can take this batch (``shape_for``)."""
        return self.shape_for(batch) is not None

    def inputs(self, shape: GraphShape) -> StepInputs:
        """The fixed buffers the graph of ``shape`` reads."""
        head = shape.layout().unpack(self.staging)
        return replace(head, block_tables=self.block_tables[: shape.num_seqs])

    @torch.inference_mode()
    def capture(self, progress: bool = True, lora: bool = False) -> None:
        """Warm up and capture every bucket of every kind, largest first, with a progress
        bar; log the time and device memory it took. ``lora``: the graphs with per-token
        LoRA slots (``forward`` must then apply the runner's adapters)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        started = time.monotonic()
        free_before = self._free_memory()
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        shapes = sorted(
            (GraphShape(bucket, q, lora) for q in self.query_lens for bucket in self.buckets),
            key=lambda shape: shape.num_tokens,
            reverse=True,  # largest first: the smaller ones reuse its memory
        )
        what = "decode step" + (" with LoRA adapters" if lora else "")
        bar = Progress(
            TextColumn(f"capturing CUDA graphs of the {what}"),
            BarColumn(),
            MofNCompleteColumn(),
            transient=True,
            disable=not progress,
        )
        shared_logits = self._logits
        try:
            with bar:
                task = bar.add_task("capture", total=len(shapes))
                for shape in shapes:
                    self._capture_one(shape)
                    bar.advance(task)
        except BaseException:  # none of this call's graphs is used: free what they hold
            for shape in shapes:
                self._replays.pop(shape, None)
                self._outputs.pop(shape, None)
            self._logits = shared_logits
            raise
        self._synchronize()
        self.lora_captured |= lora
        memory = max(0, free_before - self._free_memory())
        self.memory_bytes += memory
        verify = (
            f", and verification steps of up to {self.query_lens[-1]} tokens per sequence"
            if len(self.query_lens) > 1
            else ""
        )
        logger.info(
            "CUDA graphs: %s captured for %d batch sizes (%s)%s in %.1f s, using %.0f MiB",
            what,
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
            verify,
            time.monotonic() - started,
            memory / 2**20,
        )

    def _capture_one(self, shape: GraphShape) -> None:
        self._fill_warmup_inputs(shape)
        inputs = self.inputs(shape)
        self.forward(inputs)  # compiles and autotunes outside the capture
        self._synchronize()
        step = partial(self.forward, inputs)
        if self._logits is not None:
            step = partial(self._into_logits, step)
        replay, output = self.record(step, self._pool)
        if self._logits is None:
            self._logits = output
        self._replays[shape], self._outputs[shape] = replay, output

    def _into_logits(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``step``'s logits copied into the shared logits buffer (inside the graph, so
        its own output is freed after capture and the pool reuses that memory)."""
        logits = step()
        return self._logits[: logits.shape[0]].copy_(logits)

    @torch.inference_mode()
    def run(self, batch: StepBatch, shape: GraphShape | None = None) -> torch.Tensor:
        """The logits of a batch that fits (``shape``: ``shape_for(batch)``, computed here
        if not given), as ``forward`` would return them eagerly: stage, pad to its
        graph's shape, replay. The tensor is the graphs' output buffer, overwritten by
        the next ``run``."""
        shape = shape or self.shape_for(batch)
        if shape is None:
            raise ValueError("this batch fits no captured graph (see DecodeGraphs.shape_for)")
        staged = stage_step(batch, self.device, pad=shape, out=self.staging)
        rows, width = staged.block_tables.shape
        self.block_tables[:rows, :width].copy_(staged.block_tables)
        self._replays[shape]()
        self.replays += 1
        self.verify_replays += shape.query_len > 1
        self.lora_replays += shape.lora
        if batch.logits_indices is not None:
            num_logits = len(batch.logits_indices)
        else:
            num_logits = batch.num_seqs
        return self._outputs[shape][:num_logits]

    def _fill_warmup_inputs(self, shape: GraphShape) -> None:
        """Every real sequence at the longest context with all its tokens, over distinct
        real blocks (read, never written: slots are -1), so the kernels are compiled and
        tuned for real work; no adapter."""
        inputs = self.inputs(shape)
        query_len, bucket = shape.query_len, shape.batch
        inputs.input_ids.zero_()
        inputs.positions.zero_()
        inputs.slot_mapping.fill_(-1)
        if inputs.lora_slots is not None:
            inputs.lora_slots.fill_(-1)
        inputs.context_lens.fill_(0)
        inputs.context_lens[:bucket].fill_(self.max_blocks_per_seq * self.block_size)
        starts = torch.arange(shape.num_seqs + 1, dtype=torch.int32) * query_len
        starts[-1] = shape.num_tokens  # a verification graph's spare sequence: 1 token
        inputs.query_start_loc.copy_(starts)
        if inputs.logits_indices is not None:
            inputs.logits_indices.copy_(torch.arange(shape.num_logits, dtype=torch.int32))
        blocks = torch.arange(self.block_tables.numel(), device=self.device) % self.num_blocks
        self.block_tables.copy_(blocks.view_as(self.block_tables))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_memory(self) -> int:
        """Device memory free, with the allocator's unused cache handed back first (so the
        difference around the capture is what the graphs hold)."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]


def decode_graphs(
    forward: DecodeForward,
    *,
    enabled: bool,
    device: torch.device,
    max_batch_size: int,
    max_blocks_per_seq: int,
    block_size: int,
    num_blocks: int,
    num_speculative_tokens: int = 0,
) -> DecodeGraphs | None:
    """Captured decode graphs for a runner, or ``None`` where they do not apply: turned off
    (``cuda_graphs`` false, for debugging) or not on a CUDA device (on the CPU there are
    no launches to save, and the option is ignored)."""
    if not enabled or torch.device(device).type != "cuda":
        return None
    graphs = DecodeGraphs(
        forward,
        max_batch_size=max_batch_size,
        max_blocks_per_seq=max_blocks_per_seq,
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
        num_speculative_tokens=num_speculative_tokens,
    )
    graphs.capture()
    return graphs


class ModelRunner(Protocol):
    """Runs a model over paged KV blocks. Built by a backend, driven by the shared engine."""

    block_size: int
    num_blocks: int
    device: torch.device  # where execute's logits are (steps overlap on a GPU)
    tensor_parallel_size: int  # ranks the model is sharded over (EngineStats)
    serves_lora: bool  # LoRA adapters in slots (llmctl.engine.lora.LoraRunner)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return fp32 logits ``[num_seqs, vocab]``
        for the last new token of each sequence."""
        ...

    # Optional: ``execute_greedy(batch) -> (logits, token_ids)``, ``execute`` with each
    # row's argmax (int64, on the logits' device), which the engine uses for steps whose
    # every row is greedy (PagedRunner has one; a runner without it gets argmax_rows).

    def close(self) -> None:
        """Release what the runner holds beyond memory (worker processes); called once,
        at shutdown."""
        ...


class PagedRunner:
    """Base of a runner over a paged KV cache of ``num_blocks`` blocks.

    ``dtype`` is a name (``auto`` is the checkpoint's) or a ``torch.dtype``;
    ``kv_cache_dtype`` (``auto``: ``dtype``, ``int8``, ``fp8``) is the KV cache's.
    ``cpu_threads`` is how many threads compute on the CPU (``None``: torch's current
    count); like torch's own setting it holds for the whole process. The engine
    sizes the cache from the memory free once the weights are loaded, then calls
    ``allocate_kv_cache``; tests may pass ``num_blocks`` to the subclass directly.
    ``max_num_seqs`` and ``max_model_len`` (default: the model's context) bound the
    decode steps CUDA graphs are captured for (on CUDA, when allocating the cache);
    ``num_speculative_tokens`` k > 0 (that option of a speculating engine)
    captures verification steps of up to k + 1 tokens per sequence too;
    ``cuda_graphs=False`` turns them off.
    Subclasses implement ``_allocate(num_blocks)`` and ``forward(inputs, is_decode)``;
    one whose ``forward`` applies its adapters from ``StepInputs.lora_slots`` says so in
    ``graphs_take_lora`` (else a step with an adapter runs eagerly).
    """

    tensor_parallel_size = 1  # ranks the model is sharded over (see the torch backend)
    serves_lora = False  # a runner with adapter slots says so (llmctl.engine.lora.LoraRunner)

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        block_size: int = 64,
        kv_cache_dtype: str = "auto",
        cpu_threads: int | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        cuda_graphs: bool = True,
        base_config: ModelConfig | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.config = config
        # The whole model's sizes, which LoRA adapters must fit: a tensor-parallel rank's
        # ``config`` is its own slice of the heads and MLP, and it passes the whole.
        self.base_config = base_config or config
        self.device = torch.device(device)
        if cpu_threads and self.device.type == "cpu":
            torch.set_num_threads(cpu_threads)
        self.cpu_threads = cpu_threads or torch.get_num_threads()
        self.dtype = TORCH_DTYPES[config.resolve_dtype(dtype)] if isinstance(dtype, str) else dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        self.block_size = block_size
        self.num_blocks = 0
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or config.session_len()
        self.cuda_graphs = cuda_graphs
        self.num_speculative_tokens = num_speculative_tokens
        self.decode_graphs: DecodeGraphs | None = None
        self._lora_graphs_tried = False  # graphs with LoRA slots: captured once, or failed

    def kv_bytes_per_block(self) -> int:
        return self.config.kv_bytes_per_block(self.block_size, self.dtype, self.kv_cache_dtype)

    def weight_bytes(self) -> int | None:
        """Bytes the loaded (possibly quantized) weights take, if the runner can tell."""
        return None

    def kv_element(self) -> str:
        """What one cache element is, for the KV plan's line: ``float32``, ``int8 + scales``."""
        if self.kv_cache_dtype == "auto":
            return str(self.dtype).removeprefix("torch.")
        return f"{self.kv_cache_dtype} + scales"

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then capture the decode graphs over it (GPU only)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._allocate(num_blocks)
        self.num_blocks = num_blocks
        self.decode_graphs = decode_graphs(
            self.decode_step,
            enabled=self.captures_graphs(),
            device=self.device,
            max_batch_size=self.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            block_size=self.block_size,
            num_blocks=num_blocks,
            num_speculative_tokens=self.num_speculative_tokens,
        )

    def captures_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (``decode_graphs`` still needs CUDA)."""
        return self.cuda_graphs

    def graphs_take_lora(self) -> bool:
        """Whether ``forward`` applies the runner's adapters from the per-token slots of
        ``StepInputs.lora_slots`` with fixed shapes and no host work (so graphs with LoRA
        slots can be captured), the adapters' weights in fixed slot buffers (so putting
        another adapter in a slot keeps the graphs valid)."""
        return False

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V and return fp32 logits of the last new token of each
        sequence, ``[num_seqs, vocab]``, or of the tokens ``logits_indices`` names (on a
        GPU a graph's logits stay valid until the next ``execute``): a graph replay where
        one fits, else ``forward`` over the staged step (``eager_step``)."""
        self.check_allocated()
        graphs = self.decode_graphs
        if graphs is not None:
            if batch.lora_slots is not None and not graphs.lora_captured:
                self._capture_lora_graphs(graphs)  # the first step with an adapter
            shape = graphs.shape_for(batch)
            if shape is not None:
                return graphs.run(batch, shape)
        return self.eager_step(batch)

    def execute_greedy(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``execute``, and each row's greedy token (its first largest logit; int64 on the
        logits' device), for a step whose every row is greedy. A runner whose model finds
        those while it writes the logits overrides this (turbo's CPU LM head): read
        afterwards, logits just written by other cores cost more than the argmax itself."""
        logits = self.execute(batch)
        return logits, argmax_rows(logits)

    def _capture_lora_graphs(self, graphs: DecodeGraphs) -> None:
        """Capture the graphs with LoRA slots, once, where the runner's ``forward`` takes
        them. They come after the KV cache took its share of memory: if they do not fit,
        steps with adapters run eagerly (said once), and nothing is tried again."""
        if self._lora_graphs_tried or not self.graphs_take_lora():
            return
        self._lora_graphs_tried = True
        try:
            graphs.capture(lora=True)
        except torch.OutOfMemoryError:
            logger.warning(
                "CUDA graphs with LoRA slots do not fit in the device memory left: steps "
                "with adapters run eagerly (a smaller cache_max_entry_count leaves room)"
            )

    def eager_step(self, batch: StepBatch) -> torch.Tensor:
        """``forward`` over the staged step, outside any graph."""
        return self.forward(stage_step(batch, self.device), batch.is_decode)

    def decode_step(self, inputs: StepInputs) -> torch.Tensor:
        """The model over a graph's fixed inputs (``GraphShape``: one token per sequence,
        or up to k + 1 in a verification graph; padding allowed: slot -1 writes nothing,
        context length 0 attends to nothing, LoRA slot -1 adds nothing): what the CUDA
        graphs capture."""
        return self.forward(inputs, is_decode=inputs.is_decode)

    def forward(self, inputs: StepInputs, is_decode: bool) -> torch.Tensor:
        raise NotImplementedError

    def _allocate(self, num_blocks: int) -> None:
        raise NotImplementedError

    def new_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed KV-cache tensor (or its scales). On the CPU it takes memory only as
        its pages are first written: fresh anonymous pages from the OS are zero already,
        so nothing is written up front, and the resident size follows the blocks in use,
        not the budget (``torch.zeros`` would touch every page at once)."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        num_bytes = math.prod(shape) * dtype.itemsize
        pages = mmap.mmap(-1, num_bytes)  # the tensor keeps the mapping alive
        return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)

    def close(self) -> None:
        """Release what the runner holds beyond memory (a sharded runner's worker
        processes). The engine calls it once, at shutdown."""

    def check_allocated(self) -> None:
        if self.num_blocks == 0:
            raise RuntimeError("allocate_kv_cache(num_blocks) must be called before execute")
