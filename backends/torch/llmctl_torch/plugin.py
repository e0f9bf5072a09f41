"""Registers the torch backend with llmctl. Light on purpose: no torch import at module level."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.errors import BackendError
from llmctl.model.config import SUPPORTED_ARCHITECTURES
from llmctl.plugins import hookimpl
from llmctl_torch.config import MODEL_RULES, RULES, TorchConfig, torch_config

if TYPE_CHECKING:
    import torch

    from llmctl.model.config import ModelConfig


class TorchBackend(Backend):
    name = "torch"
    priority = 10
    description = "PyTorch engine: paged KV cache, Triton attention on GPU, plain torch on CPU"
    supported_architectures = frozenset(SUPPORTED_ARCHITECTURES)
    rules = RULES
    model_rules = MODEL_RULES

    def check_hardware(self, hardware: Hardware) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["PyTorch is not installed (pip install torch)"]
        return []

    def translate(self, options: Mapping[str, Any]) -> TorchConfig:
        return torch_config(options)

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        from llmctl.engine.assemble import build_engine
        from llmctl_torch.model import TorchModelRunner

        config = self.translate(options)
        extra = config.extra
        if extra.node_rank > 0:
            raise BackendError(
                f"node_rank {extra.node_rank} is a worker machine of a multi-node engine: "
                "run `llmctl serve` there; chat, bench and the Python API run on the head "
                "node (node_rank 0)"
            )
        sharded = []  # the tensor-parallel runner, once loaded

        def load_runner(
            loaded: ModelInfo,
            model_config: ModelConfig,
            config: TorchConfig,
            dtype: str,
            device: torch.device,
            max_model_len: int,
        ) -> TorchModelRunner:
            if config.extra.tensor_parallel_size == 1:
                return TorchModelRunner(
                    loaded.path, model_config, **config.runner_options(dtype, device, max_model_len)
                )
            from llmctl_torch.tp_runner import TensorParallelRunner, WorkerTask, topology_for

            runner = TensorParallelRunner(
                WorkerTask.of(loaded.path, config, dtype),
                model_config,
                topology_for(config, device),
                device,
            )
            sharded.append(runner)
            return runner

        try:
            engine = build_engine(model, config, hardware, load_runner)
        except BaseException:
            for runner in sharded:
                runner.close()
            raise
        for runner in sharded:  # a rank lost while idle stops the engine at once
            runner.on_failure(engine.fail)
        return engine

    def run_worker_node(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> None:
        import torch

        from llmctl_torch.tp_runner import serve_worker_node

        config = self.translate(options)
        serve_worker_node(model.path, config, torch.device(hardware.device_for(config.device)))


@hookimpl
def llmctl_register_backends(register) -> None:
    register(TorchBackend)
