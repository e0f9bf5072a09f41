"""The interface between the shared engine (scheduler, block manager, sampler) and a backend.

A backend plugs its model into the shared engine by implementing ``ModelRunner``:
the engine schedules, the runner runs one forward step over a flattened batch
(``llmctl.engine.step``). ``PagedRunner`` is what both local runners share: dtype,
device, KV-cache sizing and the checks around allocating it, and the choice of each
step's path: a decode step that fits a captured CUDA graph replays it, any other step
runs the runner's ``forward`` eagerly over the staged inputs.
"""

from __future__ import annotations

import math
import mmap
from typing import Protocol

import torch

from llmctl.engine.cuda_graphs import DecodeGraphs, decode_graphs
from llmctl.engine.quant import kv_cache_torch_dtype
from llmctl.engine.step import StepBatch, StepInputs, stage_step
from llmctl.model.config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner(Protocol):
    """Runs a model over paged KV blocks. Built by a backend, driven by the shared engine."""

    block_size: int
    num_blocks: int
    device: torch.device  # where execute's logits are (steps overlap on a GPU)
    tensor_parallel_size: int  # ranks the model is sharded over (EngineStats)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return fp32 logits ``[num_seqs, vocab]``
        for the last new token of each sequence."""
        ...

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
    ``cuda_graphs=False`` turns them off.
    Subclasses implement ``_allocate(num_blocks)`` and ``forward(inputs, is_decode)``.
    """

    tensor_parallel_size = 1  # ranks the model is sharded over (see the torch backend)

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: str | torch.dtype,
        device: str | torch.device,
        block_size: int,
        kv_cache_dtype: str = "auto",
        cpu_threads: int | None = None,
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.config = config
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
        self.decode_graphs: DecodeGraphs | None = None

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
        )

    def captures_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (``decode_graphs`` still needs CUDA)."""
        return self.cuda_graphs

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V and return fp32 logits ``[num_seqs, vocab]`` of the last new
        token of each sequence (on a GPU a decode step's logits stay valid until the next
        ``execute``): a graph replay where one fits, else ``forward`` over the staged step."""
        self.check_allocated()
        # Graphs are captured without LoRA adapters: a step with one runs eagerly.
        graphs = self.decode_graphs if batch.lora_slots is None else None
        if graphs is not None and graphs.fits(batch):
            return self.decode_graphs.run(batch)
        return self.forward(stage_step(batch, self.device), batch.is_decode)

    def decode_step(self, inputs: StepInputs) -> torch.Tensor:
        """The model over staged decode inputs (one token per sequence, padding rows
        allowed: slot -1 writes nothing, context length 0 attends to nothing): what the
        CUDA graphs capture."""
        return self.forward(inputs, is_decode=True)

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
