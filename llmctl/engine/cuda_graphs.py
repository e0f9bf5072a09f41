"""CUDA graphs of the decode step, shared by both local runners (torch and turbo).

A decode step of a small model on a big GPU is short on the device and long on the
host: Python and the launch of a few hundred kernels, layer by layer. A CUDA graph
records those launches once and replays them with one call. A graph is fixed (its
shapes, its buffers, every kernel argument), so:

- one graph per batch-size bucket (``batch_buckets``: 1, 2, 4, 8, 16, then every 16 up
  to ``max_batch_size``); a batch is padded to the smallest bucket that holds it;
- the step's inputs are staged into fixed device buffers: ONE host-to-device copy of the
  packed inputs (``llmctl.engine.runner.stage_step``) into ``staging``, whose head
  (ids, positions, slots, context lengths, query starts) the graph reads in place, then
  one device copy of the block tables into a fixed ``[max_batch_size,
  max_blocks_per_seq]`` table;
- whatever a kernel plans on the host (the Triton decode kernel's split-K plan, its
  scratch buffers for partial results) is decided from those fixed shapes at capture
  time: the table is as wide as the longest session, so the plan covers any context;
- nothing inside the captured region may synchronise with the host, allocate on the
  host or read a device value (``.item()``, ``.tolist()``).

How a runner uses it (``forward`` maps ``StepInputs`` to logits ``[batch, vocab]``)::

    graphs = decode_graphs(forward, enabled=..., device=..., max_batch_size=...,
                           max_blocks_per_seq=..., block_size=..., num_blocks=...)
    # None on the CPU or when disabled; otherwise captured already.
    if graphs is not None and graphs.fits(batch):
        return graphs.run(batch)        # logits [num_seqs, vocab], valid until next run
    return forward(stage_step(batch, device))   # eager: prefill, mixed, too large

Padding rows write nowhere (slot -1: a kernel must skip negative slots) and attend to
nothing (context length 0: output 0, no NaN). Block-table rows past the batch and
entries past a sequence's last block hold stale but valid block ids: kernels must read
only the entries below ``ceil(context_len / block_size)``.

``forward`` must be capturable: called once eagerly per bucket first (Triton compiles
and autotunes then, on inputs as long as the longest session, so the tuning is for
real work), then captured. All graphs share one memory pool, captured largest first
so the smaller ones reuse its memory.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from llmctl.engine.step import StepBatch, StepInputs, StepLayout, stage_step

logger = logging.getLogger("llmctl")

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
    """Capture ``fn`` into a CUDA graph using the memory ``pool``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
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
    """The decode step of one runner, captured for every batch-size bucket.

    ``forward(inputs) -> logits [batch, vocab]`` is the runner's step (see the module
    docstring). ``max_blocks_per_seq`` is the block-table width of the longest session;
    ``block_size`` and ``num_blocks`` describe the allocated KV cache (the warm-up reads
    it, and writes nothing). ``record`` is ``record_cuda_graph``; ``replay_eagerly`` lets
    the staging and padding be checked on a machine without a GPU.
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
        record: Recorder = record_cuda_graph,
    ) -> None:
        self.forward = forward
        self.buckets = batch_buckets(max_batch_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.record = record
        largest = self.buckets[-1]
        # Where stage_step's one copy lands; each bucket's graph reads its head in place.
        staging_size = StepLayout(largest, largest, largest, max_blocks_per_seq).size
        self.staging = torch.zeros(staging_size, dtype=torch.int32, device=self.device)
        self.block_tables = torch.zeros(
            (largest, max_blocks_per_seq), dtype=torch.int32, device=self.device
        )
        self._replays: dict[int, Callable[[], None]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0
        self.replays = 0  # decode steps served by a graph (tests and benchmarks count them)

    def fits(self, batch: StepBatch) -> bool:
        """Whether ``run`` can take this batch: a decode step within the largest bucket
        whose block tables fit the captured width (the scheduler's session length
        guarantees it; a wider one would run eagerly)."""
        return (
            batch.is_decode
            and batch.logits_indices is None
            and batch.num_seqs <= self.buckets[-1]
            and batch.block_table_array().shape[1] <= self.max_blocks_per_seq
        )

    def inputs(self, bucket: int) -> StepInputs:
        """The fixed buffers the graph of ``bucket`` reads."""
        head = StepLayout(bucket, bucket, 0, 0).unpack(self.staging)
        return replace(head, block_tables=self.block_tables[:bucket])

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Warm up and capture every bucket, largest first, with a progress bar; log the
        time and device memory it took."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        started = time.monotonic()
        free_before = self._free_memory()
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        bar = Progress(
            TextColumn("capturing CUDA graphs of the decode step"),
            BarColumn(),
            MofNCompleteColumn(),
            transient=True,
            disable=not progress,
        )
        with bar:
            task = bar.add_task("capture", total=len(self.buckets))
            for bucket in reversed(self.buckets):
                self._fill_warmup_inputs(bucket)
                inputs = self.inputs(bucket)
                self.forward(inputs)  # compiles and autotunes outside the capture
                self._synchronize()
                replay, output = self.record(partial(self.forward, inputs), pool)
                self._replays[bucket], self._outputs[bucket] = replay, output
                bar.advance(task)
        self._synchronize()
        self.memory_bytes = max(0, free_before - self._free_memory())
        logger.info(
            "CUDA graphs: decode captured for %d batch sizes (%s) in %.1f s, using %.0f MiB",
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
            time.monotonic() - started,
            self.memory_bytes / 2**20,
        )

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` of a decode batch (``fits(batch)``): stage, pad to
        its bucket, replay. The tensor is the graph's output buffer, overwritten by the
        next ``run``."""
        bucket = bucket_for(batch.num_seqs, self.buckets)
        staged = stage_step(batch, self.device, pad_to=bucket, out=self.staging)
        rows, width = staged.block_tables.shape
        self.block_tables[:rows, :width].copy_(staged.block_tables)
        self._replays[bucket]()
        self.replays += 1
        return self._outputs[bucket][: batch.num_seqs]

    def _fill_warmup_inputs(self, bucket: int) -> None:
        """Every sequence at the longest context, over distinct real blocks (read, never
        written: slots are -1), so the kernels are compiled and tuned for real work."""
        inputs = self.inputs(bucket)
        inputs.input_ids.zero_()
        inputs.positions.zero_()
        inputs.slot_mapping.fill_(-1)
        inputs.context_lens.fill_(self.max_blocks_per_seq * self.block_size)
        inputs.query_start_loc.copy_(torch.arange(bucket + 1, dtype=torch.int32))
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
    )
    graphs.capture()
    return graphs
