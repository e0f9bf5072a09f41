"""Tensor-parallel runners: every rank runs its shard of the model on each step, whose
inputs rank 0 (the engine's runner) broadcasts first.

``ShardRunner`` is one rank's ``TorchModelRunner``: its shard of the weights
(``parallel.py``) and its part of the KV cache (its KV heads), driven through the same
``execute`` as the single-device runner. ``TensorParallelRunner`` is rank 0: it starts
and joins the other ranks (``distributed.py``) and sends each call to them before running
its own part. ``run_worker`` is every other rank's process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llmctl.engine.assemble import engine_dtype
from llmctl.engine.runner import StepBatch
from llmctl.errors import EngineDead
from llmctl.model.config import ModelConfig
from llmctl_torch.config import TorchConfig
from llmctl_torch.distributed import STOP, HeadRanks, Topology, WorkerLink, run_worker_node
from llmctl_torch.lora import LoraWeights
from llmctl_torch.model import TorchModelRunner
from llmctl_torch.parallel import (
    ParallelLlamaForCausalLM,
    Shard,
    load_shard,
    local_config,
    lora_shard,
)

logger = logging.getLogger("llmctl")


@dataclass(frozen=True)
class WorkerTask:
    """What a worker process needs to build its shard (picklable: it crosses ``spawn``)."""

    model_dir: str
    dtype: str | torch.dtype
    block_size: int
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    max_loras: int = 4
    max_lora_rank: int = 16

    @classmethod
    def of(cls, model_dir: str | Path, config: TorchConfig, dtype: str | torch.dtype) -> WorkerTask:
        """The task of the engine ``config`` describes."""
        return cls(
            str(model_dir),
            dtype,
            config.block_size,
            config.quantization,
            config.kv_cache_dtype,
            config.lora.max_loras,
            config.lora.max_rank,
        )


class ShardRunner(TorchModelRunner):
    """One rank's runner: its shard of the model and the KV cache of its KV heads.
    ``execute`` returns the logits on rank 0 and ``None`` elsewhere. Decode runs eagerly:
    CUDA graphs are not captured over the ranks' collectives (yet)."""

    def __init__(
        self, task: WorkerTask, shard: Shard, device: torch.device, config: ModelConfig
    ) -> None:
        self.shard = shard
        self.tensor_parallel_size = shard.size
        # The base class sizes the cache from the config: this rank's heads.
        super().__init__(
            task.model_dir,
            local_config(config, shard.size),
            dtype=task.dtype,
            device=device,
            block_size=task.block_size,
            cuda_graphs=False,
            quantization=task.quantization,
            kv_cache_dtype=task.kv_cache_dtype,
            max_loras=task.max_loras,
            max_lora_rank=task.max_lora_rank,
            base_config=config,  # before _load_model, which reads it
        )

    def load_lora_slot(self, slot: int, weights: LoraWeights) -> None:
        """Put this rank's part of the adapter (``lora_shard``) in ``slot``."""
        rank, size = self.shard.rank, self.shard.size
        super().load_lora_slot(slot, lora_shard(weights, self.base_config, rank, size))

    def _load_model(self, model_dir: str | Path) -> ParallelLlamaForCausalLM:
        return load_shard(str(model_dir), self.base_config, self.shard, self.dtype, self.device)


class TensorParallelRunner(ShardRunner):
    """Rank 0: starts and joins the other ranks, then runs its own shard like each of
    them, sending every call (allocate the cache, run a step) to them first. A rank that
    dies or hangs makes the call raise ``EngineDead`` naming it; so does ``on_failure``,
    called from the watching thread when the engine is idle."""

    def __init__(
        self, task: WorkerTask, config: ModelConfig, topology: Topology, device: torch.device
    ) -> None:
        self.ranks = HeadRanks(topology, run_worker, task)
        self._threads_before = torch.get_num_threads()
        self._rank_threads = topology.threads_per_rank() if device.type == "cpu" else None
        try:
            device = topology.device(0) if device.type == "cuda" else device
            super().__init__(task, Shard(0, topology.size), device, config)
            self.ranks.wait_until_ready()
        except BaseException:
            self.close()
            raise
        logger.info(
            "tensor parallel: %d ranks on %d machine(s), %s",
            topology.size,
            topology.nnodes,
            "NCCL, one GPU each" if device.type == "cuda" else "gloo on CPU",
        )

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when a rank fails while no call is running."""
        self.ranks.on_failure = callback

    def kv_bytes_per_block(self) -> int:
        """What one block costs the memory the engine sized the cache from: on CPU every
        rank of this machine holds its part in the same RAM; on CUDA each has its GPU."""
        per_rank = super().kv_bytes_per_block()
        return per_rank * (self.ranks.topology.ranks_per_node if self.device.type == "cpu" else 1)

    @contextmanager
    def _on_all_ranks(self, command: tuple[str, Any]) -> Iterator[None]:
        """Send ``command`` to the other ranks, then run the body (this rank's part); a
        failure of any rank becomes ``EngineDead`` naming it."""
        with self.ranks.lock:
            try:
                self.ranks.broadcast(command)
                yield
            except EngineDead:
                raise
            except Exception as exc:
                raise EngineDead(self.ranks.diagnose(exc)) from exc

    def allocate_lora_slots(self) -> None:
        if self.loras is None:
            with self._on_all_ranks(("lora_slots", None)):
                super().allocate_lora_slots()

    def load_lora_slot(self, slot: int, weights: LoraWeights) -> None:
        # Slots first, on every rank: inside the call below this rank's own load finds
        # them there (allocating them in it would send to the ranks under the same lock).
        self.allocate_lora_slots()
        # Every rank gets the whole adapter (host memory, pickled) and keeps its part.
        with self._on_all_ranks(("lora", (slot, weights))):
            super().load_lora_slot(slot, weights)

    def _allocate(self, num_blocks: int) -> None:
        with self._on_all_ranks(("allocate", num_blocks)):
            super()._allocate(num_blocks)
            dist.barrier()  # every rank has its cache (one out of memory is named here)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        self._use_rank_threads()
        batch = with_host_tokens(batch)
        with self._on_all_ranks(("step", batch)):
            return super().execute(batch)

    def _use_rank_threads(self) -> None:
        """On CPU this machine's ranks split its cores. torch's thread count belongs to
        the thread that sets it, so it is set in the one that runs the model (the
        engine's), and the caller's threads keep theirs."""
        if self._rank_threads and torch.get_num_threads() != self._rank_threads:
            torch.set_num_threads(self._rank_threads)

    def close(self) -> None:
        self.ranks.close()
        if self._rank_threads:  # the default for threads started from now on
            torch.set_num_threads(self._threads_before)


def with_host_tokens(batch: StepBatch) -> StepBatch:
    """``batch`` with every input token on the host. When steps overlap (on a GPU) some
    are still on rank 0's device, where the other ranks cannot read them: this waits for
    them, so sharded steps do not overlap."""
    fill = batch.sampled_tokens
    if fill is None:
        return batch
    input_ids = np.array(batch.input_ids, dtype=np.int32)
    if fill.token_indices is None:  # the first ones, in order
        input_ids[: len(fill.token_ids)] = fill.token_ids.cpu().numpy()
    else:
        input_ids[fill.token_indices.cpu().numpy()] = fill.token_ids.cpu().numpy()
    return replace(batch, input_ids=input_ids, sampled_tokens=None)


def run_worker(topology: Topology, task: WorkerTask, rank: int) -> None:
    """A worker rank's process: join, load the shard, then follow rank 0's commands."""
    link = WorkerLink(topology, rank)
    try:
        if topology.device_type == "cpu":
            torch.set_num_threads(topology.threads_per_rank())
        runner = ShardRunner(
            task,
            Shard(rank, topology.size),
            topology.device(rank),
            ModelConfig.from_dir(task.model_dir),
        )
        link.ready()
        while (command := link.receive()) != STOP:
            kind, value = command
            if kind == "step":
                runner.execute(value)
            elif kind == "lora":
                runner.load_lora_slot(*value)
            elif kind == "lora_slots":
                runner.allocate_lora_slots()
            else:
                runner.allocate_kv_cache(value)
                dist.barrier()
    except Exception as exc:
        link.exit(f"{type(exc).__name__}: {exc}")
    link.leave()


def topology_for(config: TorchConfig, device: torch.device) -> Topology:
    extra = config.extra
    return Topology(
        size=extra.tensor_parallel_size,
        nnodes=extra.nnodes,
        node_rank=extra.node_rank,
        master_addr=extra.master_addr,
        master_port=extra.master_port,
        device_type=device.type,
        cpu_threads=config.cpu_threads,
    )


def serve_worker_node(model_dir: str | Path, config: TorchConfig, device: torch.device) -> None:
    """``llmctl serve --node-rank R`` (R > 0): run this machine's ranks until the head
    node stops them."""
    model_config = ModelConfig.from_dir(model_dir)
    dtype = engine_dtype(config.dtype, model_config, device)
    topology = topology_for(config, device)
    run_worker_node(
        topology,
        run_worker,
        WorkerTask.of(model_dir, config, dtype),
    )
