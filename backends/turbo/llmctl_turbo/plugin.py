"""Registers the turbo backend with llmctl. Light on purpose: no torch import at module level."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.kv_budget import KVBudget, parse_kv_budget
from llmctl.plugins import hookimpl

LLAMA_FAMILY = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})


@dataclass(frozen=True)
class TurboConfig:
    """The turbo engine's own names for the unified options (TurboMind-style)."""

    cache_block_seq_len: int
    cache_max_entry_count: KVBudget
    session_len: int | None
    max_batch_size: int
    max_prefill_token_num: int
    enable_prefix_caching: bool
    dtype: str
    device: str
    seed: int
    chat_template: str | None
    model_name: str | None


def block_size_rule(on_cuda: bool, hardware: Hardware) -> tuple[int, str]:
    """The multiple turbo's kernels need, and why (the rules of DESIGN.md)."""
    if not on_cuda:
        return 16, "turbo's CPU kernels need a multiple of 16"
    major, minor = hardware.compute_capability or (0, 0)
    if major >= 8:
        return (
            32,
            f"turbo's CUDA kernels need a multiple of 32 on compute capability {major}.{minor}",
        )
    return 64, (
        f"turbo's CUDA kernels need a multiple of 64 on compute capability {major}.{minor} (< 8.0)"
    )


class TurboBackend(Backend):
    name = "turbo"
    priority = 20
    description = "native C++/CUDA engine: one C++ call per scheduler step"
    supported_architectures = LLAMA_FAMILY

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

    def option_errors(self, options: Mapping[str, Any], hardware: Hardware) -> dict[str, str]:
        errors = {}
        if options.get("adapters"):
            errors["adapters"] = "turbo does not support LoRA adapters (use the torch backend)"
        on_cuda = hardware.device_for(options.get("device", "auto")) == "cuda"
        if options.get("device") == "cuda" and not hardware.cuda_available:
            errors["device"] = "device 'cuda' asked for, but no CUDA GPU is available here"
        block = options.get("cache_block_seq_len")
        multiple, rule = block_size_rule(on_cuda, hardware)
        if block is not None and block % multiple:
            errors["cache_block_seq_len"] = rule
        return errors

    def translate(self, options: Mapping[str, Any]) -> TurboConfig:
        return TurboConfig(
            cache_block_seq_len=options["cache_block_seq_len"],
            cache_max_entry_count=parse_kv_budget(options["cache_max_entry_count"]),
            session_len=options["session_len"],
            max_batch_size=options["max_batch_size"],
            max_prefill_token_num=options["max_prefill_token_num"],
            enable_prefix_caching=options["enable_prefix_caching"],
            dtype=options["dtype"],
            device=options["device"],
            seed=options["seed"],
            chat_template=options["chat_template"],
            model_name=options["model_name"],
        )

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        from llmctl_turbo.engine import create_turbo_engine

        return create_turbo_engine(model, self.translate(options), hardware)


@hookimpl
def llmctl_register_backends(register) -> None:
    register(TurboBackend)
