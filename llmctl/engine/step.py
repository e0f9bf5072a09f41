"""One scheduler step as the runners see it: ``StepBatch`` (flattened new tokens, positions,
block tables, slots), and how a runner turns it into device tensors: ``stage_step`` packs
every input into one int32 buffer and copies it to the device once (``StepLayout`` says
where each input sits, the same offsets for a padded decode batch of a given size, as
CUDA graphs need).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A step's integers: a list, or (as the engine builds them) a 1-D int32 numpy array.
IntArray = list[int] | np.ndarray


@dataclass
class SampledTokenFill:
    """Input tokens of a step that the step before sampled and the host has not seen yet
    (steps overlap on the GPU): ``token_ids[i]`` goes to ``input_ids[token_indices[i]]``.
    Both tensors are on the device."""

    token_indices: torch.Tensor
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
        if fill is not None:
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

    def logits_rows(self) -> torch.Tensor:
        """Indices of the tokens whose logits the step returns."""
        if self.logits_indices is not None:
            return self.logits_indices
        return self.query_start_loc[1:] - 1


@dataclass(frozen=True)
class StepLayout:
    """Where each input sits in a step's packed int32 buffer, in this order:
    ``input_ids``, ``positions``, ``slot_mapping`` (``num_tokens`` each), ``context_lens``
    (``num_seqs``), ``query_start_loc`` (``num_seqs + 1``), then the block tables
    (``table_rows`` x ``table_width``), then ``num_logits`` logits indices (a speculative
    step's; none otherwise). The part before the tables depends only on ``num_tokens``
    and ``num_seqs``, so a padded decode batch of a given size always finds it at the
    same offsets (what CUDA graphs need)."""

    num_tokens: int
    num_seqs: int
    table_rows: int
    table_width: int
    num_logits: int = 0

    @property
    def head_size(self) -> int:
        """Entries before the block tables."""
        return 3 * self.num_tokens + 2 * self.num_seqs + 1

    @property
    def size(self) -> int:
        return self.head_size + self.table_rows * self.table_width + self.num_logits

    def unpack(self, packed: torch.Tensor) -> StepInputs:
        """Views of ``packed`` (at least ``size`` entries) as the step's inputs."""
        tokens, seqs = self.num_tokens, self.num_seqs
        table_size = self.table_rows * self.table_width
        parts = packed[: self.size].split(
            [tokens, tokens, tokens, seqs, seqs + 1, table_size, self.num_logits]
        )
        tables = parts[5].view(self.table_rows, self.table_width)
        return StepInputs(*parts[:5], tables, parts[6] if self.num_logits else None)


def pack_step(batch: StepBatch, pad_to: int | None = None) -> tuple[np.ndarray, StepLayout]:
    """The step's inputs as one flat int32 array, laid out as ``StepLayout`` says.

    ``pad_to`` pads a decode batch (one token per sequence) to that many sequences: the
    padding feeds token 0 at position 0, writes nowhere (slot -1) and attends to nothing
    (context length 0). Block tables are sent for the real sequences only, each padded
    with block 0 to the longest (entries past a sequence's context are never read).
    """
    num_seqs = batch.num_seqs
    pad = 0 if pad_to is None else pad_to - num_seqs
    if pad and not batch.is_decode:
        raise ValueError("only a decode batch (one token per sequence) can be padded")
    if pad < 0:
        raise ValueError(f"cannot pad a batch of {num_seqs} sequences to {pad_to}")
    logits_indices = np.zeros(0) if batch.logits_indices is None else batch.logits_indices
    if pad and len(logits_indices):
        raise ValueError("a batch with logits_indices cannot be padded")
    tables = batch.block_table_array()
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(batch.query_lens, out=query_start_loc[1:])
    zeros = np.zeros(pad, dtype=np.int64)
    flat = np.concatenate(
        [
            batch.input_ids,
            zeros,
            batch.positions,
            zeros,
            batch.slot_mapping,
            np.full(pad, -1),
            batch.context_lens,
            zeros,
            query_start_loc,
            query_start_loc[-1] + 1 + np.arange(pad),  # one (padding) token per padded sequence
            tables.reshape(-1),
            logits_indices,
        ]
    ).astype(np.int32)
    layout = StepLayout(
        len(batch.input_ids) + pad, num_seqs + pad, *tables.shape, len(logits_indices)
    )
    return flat, layout


def stage_step(
    batch: StepBatch,
    device: torch.device,
    *,
    pad_to: int | None = None,
    out: torch.Tensor | None = None,
) -> StepInputs:
    """The step's inputs on ``device`` with ONE host-to-device copy (see ``pack_step``).

    On CUDA the packed buffer is pinned and copied without blocking the host. ``out``
    (int32, on ``device``, at least ``StepLayout.size`` entries) is where the copy lands;
    by default a new tensor. Per-step Python work matters at a few hundred microseconds a
    step, so this makes one tensor, not one per input.
    """
    flat, layout = pack_step(batch, pad_to)
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
