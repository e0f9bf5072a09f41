"""The interface between the shared engine (scheduler, block manager, sampler) and a backend.

A backend plugs its model into the shared engine by implementing ``ModelRunner``:
the engine schedules, the runner runs one forward step over a flattened batch.
``PagedRunner`` is what both local runners share: dtype, device, KV-cache sizing and
the checks around allocating it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from llmctl.engine.model_config import ModelConfig
from llmctl.engine.quant import kv_cache_torch_dtype

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepBatch:
    """One scheduler step: the new tokens of every scheduled sequence, flattened.

    Sequence ``i`` contributes ``query_lens[i]`` new tokens (a prefill chunk, or 1 for
    decode). Its KV cache holds ``context_lens[i]`` tokens once this step has written
    the new ones, so its new tokens sit at positions
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``.
    ``slot_mapping[t]`` is the physical cache slot (``block * block_size + offset``)
    where new token ``t`` writes its K/V.
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class ModelRunner(Protocol):
    """Runs a model over paged KV blocks. Built by a backend, driven by the shared engine."""

    block_size: int
    num_blocks: int

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return fp32 logits ``[num_seqs, vocab]``
        for the last new token of each sequence."""
        ...


class PagedRunner:
    """Base of a runner over a paged KV cache of ``num_blocks`` blocks.

    ``dtype`` is a name (``auto`` is the checkpoint's) or a ``torch.dtype``;
    ``kv_cache_dtype`` (``auto``: ``dtype``, ``int8``, ``fp8``) is the KV cache's. The engine
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
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[config.resolve_dtype(dtype)] if isinstance(dtype, str) else dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        self.block_size = block_size
        self.num_blocks = 0

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
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._allocate(num_blocks)
        self.num_blocks = num_blocks

    def _allocate(self, num_blocks: int) -> None:
        raise NotImplementedError

    def check_allocated(self) -> None:
        if self.num_blocks == 0:
            raise RuntimeError("allocate_kv_cache(num_blocks) must be called before execute")
