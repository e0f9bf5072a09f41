"""The interface between the shared engine (scheduler, block manager, sampler) and a backend.

A backend plugs its model into the shared engine by implementing ``ModelRunner``:
the engine schedules, the runner runs one forward step over a flattened batch.
``PagedRunner`` is what both local runners share: dtype, device, KV-cache sizing and
the checks around allocating it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from llmctl.engine.model_config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """

    input_ids: IntArray
    positions: IntArray
    query_lens: IntArray
    context_lens: IntArray
    block_tables: list[list[int]] | np.ndarray
    slot_mapping: IntArray
    sampled_tokens: SampledTokenFill | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

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


class ModelRunner(Protocol):
    """Runs a model over paged KV blocks. Built by a backend, driven by the shared engine."""

    block_size: int
    num_blocks: int
    device: torch.device  # where execute's logits are (steps overlap on a GPU)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return fp32 logits ``[num_seqs, vocab]``
        for the last new token of each sequence."""
        ...


class PagedRunner:
    """Base of a runner over a paged KV cache of ``num_blocks`` blocks.

    ``dtype`` is a name (``auto`` is the checkpoint's) or a ``torch.dtype``. The engine
    sizes the cache from the memory free once the weights are loaded, then calls
    ``allocate_kv_cache``; tests may pass ``num_blocks`` to the subclass directly.
    Subclasses implement ``_allocate(num_blocks)`` and ``execute``.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: str | torch.dtype,
        device: str | torch.device,
        block_size: int,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[config.resolve_dtype(dtype)] if isinstance(dtype, str) else dtype
        self.block_size = block_size
        self.num_blocks = 0

    def kv_bytes_per_block(self) -> int:
        return self.config.kv_bytes_per_block(self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._allocate(num_blocks)
        self.num_blocks = num_blocks

    def _allocate(self, num_blocks: int) -> None:
        raise NotImplementedError

    def check_allocated(self) -> None:
        if self.num_blocks == 0:
            raise RuntimeError("allocate_kv_cache(num_blocks) must be called before execute")
