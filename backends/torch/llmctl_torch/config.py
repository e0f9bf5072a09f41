"""The torch engine's configuration in its own (vLLM-style) names, and its option rules.

``TorchConfig.from_options`` is the one place the unified option names map to these. The shared
engine reads this config directly (its field names are the ``EngineOptions`` ones).
Light on purpose: no torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.backend import CUDA_GRAPHS_RULE, DEVICE_RULE, OptionRule, fp8_problem
from llmctl.kv_budget import KVBudget, parse_kv_budget


@dataclass(frozen=True)
class TorchConfig:
    block_size: int
    kv_budget: KVBudget
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    dtype: str
    device: str
    quantization: str
    kv_cache_dtype: str
    lora_adapters: tuple[str, ...]
    seed: int
    chat_template: str | None
    served_model_name: str | None
    enforce_eager: bool  # no CUDA graphs (vLLM's name): the unified cuda_graphs, negated

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TorchConfig:
        """The one place the unified option names map to the torch engine's."""
        return cls(
            block_size=options["cache_block_seq_len"],
            kv_budget=parse_kv_budget(options["cache_max_entry_count"]),
            max_model_len=options["session_len"],
            max_num_seqs=options["max_batch_size"],
            max_num_batched_tokens=options["max_prefill_token_num"],
            enable_prefix_caching=options["enable_prefix_caching"],
            dtype=options["dtype"],
            device=options["device"],
            quantization=options["quantization"],
            kv_cache_dtype=options["kv_cache_dtype"],
            lora_adapters=tuple(options["adapters"] or ()),
            seed=options["seed"],
            chat_template=options["chat_template"],
            served_model_name=options["model_name"],
            enforce_eager=not options["cuda_graphs"],
        )


def block_size_problem(block_size: int) -> str | None:
    """Why the torch backend's kernels cannot use ``block_size`` (``None``: they can).
    Also checked by the Triton kernels themselves."""
    if block_size < 16 or block_size & (block_size - 1):
        return (
            "the torch backend needs a power of two of at least 16 (Triton tiles are "
            "powers of two): use 16, 32, 64, 128 or 256"
        )
    return None


RULES = (
    OptionRule(
        "cache_block_seq_len",
        "a power of two >= 16",
        lambda value, options, hardware: block_size_problem(value),
    ),
    OptionRule(
        "quantization",
        "`int8` on CPU (torch's int8 kernel) and CUDA (a Triton GEMM)",
        lambda value, options, hardware: None,
    ),
    OptionRule(
        "kv_cache_dtype",
        "`int8` everywhere; `fp8` on CUDA with compute capability >= 8.9",
        lambda value, options, hardware: fp8_problem(options, hardware) if value == "fp8" else None,
    ),
    DEVICE_RULE,
    CUDA_GRAPHS_RULE,
)
