"""Registers the turbo backend with llmctl. Light on purpose: no torch import at module level."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.engine.config import EngineConfig
from llmctl.plugins import hookimpl
from llmctl_turbo.config import LLAMA_FAMILY, MODEL_RULES, RULES

if TYPE_CHECKING:
    import torch

    from llmctl.model.config import ModelConfig


class TurboBackend(Backend):
    name = "turbo"
    priority = 20
    description = "native C++/CUDA engine: one C++ call per scheduler step"
    supported_architectures = LLAMA_FAMILY
    rules = RULES
    model_rules = MODEL_RULES

    def check_hardware(self, hardware: Hardware) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["PyTorch is not installed (pip install torch)"]
        if hardware.cxx_compiler is None:
            return ["no C++ compiler found to build turbo's native ops (install g++ or set CXX)"]
        from llmctl_turbo.build import build_problem

        problem = build_problem(hardware)
        return [problem] if problem else []

    def prepare(self, hardware: Hardware) -> str:
        """Build the native ops now (retrying a build that failed before)."""
        from llmctl_turbo.build import prepare

        return prepare(hardware)

    def translate(self, options: Mapping[str, Any]) -> EngineConfig:
        return EngineConfig.from_options(options)

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        from llmctl.engine.assemble import build_engine
        from llmctl_turbo.runner import TurboModelRunner

        def load_runner(
            loaded: ModelInfo,
            model_config: ModelConfig,
            config: EngineConfig,
            dtype: str,
            device: torch.device,
            max_model_len: int,
        ) -> TurboModelRunner:
            return TurboModelRunner(
                loaded.path,
                model_config,
                quantization_group_size=config.quantization_group_size,
                quantization_zero_point=config.quantization_zero_point,
                **config.runner_options(dtype, device, max_model_len),
            )

        return build_engine(model, self.translate(options), hardware, load_runner)


@hookimpl
def llmctl_register_backends(register) -> None:
    register(TurboBackend)
