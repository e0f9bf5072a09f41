"""Registers the torch backend with llmctl. Light on purpose: no torch import at module level."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.engine.model_config import SUPPORTED_ARCHITECTURES
from llmctl.kv_budget import KVBudget, parse_kv_budget
from llmctl.plugins import hookimpl


@dataclass(frozen=True)
class TorchConfig:
    """The torch engine's own names for the unified options (vLLM-style)."""

    block_size: int
    kv_budget: KVBudget
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    dtype: str
    device: str
    lora_adapters: tuple[str, ...]
    seed: int
    chat_template: str | None
    served_model_name: str | None


class TorchBackend(Backend):
    name = "torch"
    priority = 10
    description = "PyTorch engine: paged KV cache, Triton attention on GPU, plain torch on CPU"
    supported_architectures = frozenset(SUPPORTED_ARCHITECTURES)

    def check_hardware(self, hardware: Hardware) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["PyTorch is not installed (pip install torch)"]
        return []

    def option_errors(self, options: Mapping[str, Any], hardware: Hardware) -> dict[str, str]:
        errors = {}
        block = options.get("cache_block_seq_len")
        if block is not None and (block < 16 or block & (block - 1)):
            errors["cache_block_seq_len"] = (
                "the torch backend needs a power of two of at least 16 (Triton tiles are "
                "powers of two): use 16, 32, 64, 128 or 256"
            )
        if options.get("device") == "cuda" and not hardware.cuda_available:
            errors["device"] = "device 'cuda' asked for, but no CUDA GPU is available here"
        return errors

    def translate(self, options: Mapping[str, Any]) -> TorchConfig:
        return TorchConfig(
            block_size=options["cache_block_seq_len"],
            kv_budget=parse_kv_budget(options["cache_max_entry_count"]),
            max_model_len=options["session_len"],
            max_num_seqs=options["max_batch_size"],
            max_num_batched_tokens=options["max_prefill_token_num"],
            enable_prefix_caching=options["enable_prefix_caching"],
            dtype=options["dtype"],
            device=options["device"],
            lora_adapters=tuple(options["adapters"] or ()),
            seed=options["seed"],
            chat_template=options["chat_template"],
            served_model_name=options["model_name"],
        )

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        from llmctl_torch.engine import create_torch_engine

        return create_torch_engine(model, self.translate(options), hardware)


@hookimpl
def llmctl_register_backends(register) -> None:
    register(TorchBackend)
