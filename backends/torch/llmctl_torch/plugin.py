"""Registers the torch backend with llmctl. Light on purpose: no torch import at module level."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.engine.model_config import SUPPORTED_ARCHITECTURES
from llmctl.plugins import hookimpl
from llmctl_torch.config import RULES, TorchConfig


class TorchBackend(Backend):
    name = "torch"
    priority = 10
    description = "PyTorch engine: paged KV cache, Triton attention on GPU, plain torch on CPU"
    supported_architectures = frozenset(SUPPORTED_ARCHITECTURES)
    rules = RULES

    def check_hardware(self, hardware: Hardware) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["PyTorch is not installed (pip install torch)"]
        return []

    def translate(self, options: Mapping[str, Any]) -> TorchConfig:
        return TorchConfig.from_options(options)

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        from llmctl.engine.assemble import build_engine
        from llmctl_torch.runner import TorchModelRunner

        config = self.translate(options)

        def load_runner(model_config, dtype, device, max_model_len) -> TorchModelRunner:
            return TorchModelRunner(
                model.path,
                model_config,
                dtype=dtype,
                device=device,
                block_size=config.block_size,
                adapters=config.lora_adapters,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len,
                enforce_eager=config.enforce_eager,
                quantization=config.quantization,
                kv_cache_dtype=config.kv_cache_dtype,
            )

        return build_engine(model, config, hardware, load_runner)


@hookimpl
def llmctl_register_backends(register) -> None:
    register(TorchBackend)
