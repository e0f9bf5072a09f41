"""The transformers engine's settings in transformers' own names, and this backend's rules.

``TransformersConfig.from_options`` is the one place llmctl's unified options become the
names of transformers' ``ContinuousBatchingConfig``. Each value this backend refuses has an
``OptionRule`` of its own (``RULES``): its summary joins the option's help, its check names
option, value and reason. Light on purpose (imported whenever ``llmctl`` starts): no
transformers, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.backend import (
    DEVICE_RULE,
    TORCH_THREADS_RULE,
    Hardware,
    OptionRule,
    cuda_graphs_note,
    no_speculation_rule,
    one_device_rules,
)
from llmctl.kv_budget import KVBudget, parse_kv_budget

# transformers' ContinuousBatchingConfig.page_size default: tokens per page of its paged cache.
DEFAULT_PAGE_SIZE = 256
# Tokens in one batch (prefill chunks and decodes): transformers' default is 8192, but with
# eager or SDPA attention (no flash attention: always on CPU) it allocates an attention mask
# of max_batch_tokens x (cache tokens + max_batch_tokens), which at 8192 dwarfs the cache.
DEFAULT_BATCH_TOKENS = 512
# transformers' own lower bound on page_size (BOUNDS["page_size"] in
# transformers/generation/continuous_batching/initialization.py; a test keeps them equal).
MIN_PAGE_SIZE = 4


@dataclass(frozen=True)
class TransformersConfig:
    """The engine's settings in transformers' names (``ContinuousBatchingConfig``).

    The KV-cache budget arrives in one of three forms; exactly one of ``num_blocks``,
    ``max_memory_percent`` and ``max_cache_bytes`` is set.
    """

    page_size: int
    num_blocks: int | None  # a block count: that many blocks of page_size tokens
    max_memory_percent: float | None  # a fraction of the memory free once the model is loaded
    max_cache_bytes: int | None  # a size: as many blocks as fit in it
    max_batch_tokens: int
    max_requests_per_batch: int
    allow_block_sharing: bool
    use_cuda_graph: bool | None  # None: transformers decides where its graphs apply
    dtype: str
    device: str
    cpu_threads: int | None  # None: torch's own count
    seed: int
    max_model_len: int | None
    chat_template: str | None
    served_model_name: str | None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TransformersConfig:
        """The one place the unified option names map to transformers' own."""
        budget = parse_kv_budget(options["cache_max_entry_count"])
        return cls(
            page_size=options["cache_block_seq_len"],
            num_blocks=int(budget.value) if budget.kind == "blocks" else None,
            max_memory_percent=budget.value if budget.kind == "fraction" else None,
            max_cache_bytes=int(budget.value) if budget.kind == "bytes" else None,
            max_batch_tokens=options["max_prefill_token_num"],
            max_requests_per_batch=options["max_batch_size"],
            allow_block_sharing=options["enable_prefix_caching"],
            # On, transformers captures graphs where its paths support them (CUDA with
            # the attention kernels they need); off, never.
            use_cuda_graph=None if options["cuda_graphs"] else False,
            dtype=options["dtype"],
            device=options["device"],
            cpu_threads=options["cpu_threads"],
            seed=options["seed"],
            max_model_len=options["session_len"],
            chat_template=options["chat_template"],
            served_model_name=options["model_name"],
        )

    @property
    def kv_budget(self) -> KVBudget:
        """The budget back in llmctl's form, to plan blocks as the other backends do."""
        if self.num_blocks is not None:
            return KVBudget("blocks", self.num_blocks)
        if self.max_memory_percent is not None:
            return KVBudget("fraction", self.max_memory_percent)
        return KVBudget("bytes", self.max_cache_bytes)


def refuse_small_page(value: int, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """cache_block_seq_len -> page_size: transformers' pages hold at least 4 tokens."""
    if value < MIN_PAGE_SIZE:
        return (
            f"transformers' paged cache needs pages of at least {MIN_PAGE_SIZE} tokens "
            f"(its default, and this backend's, is {DEFAULT_PAGE_SIZE})"
        )
    return None


def refuse_batch_over_tokens(
    value: int, options: Mapping[str, Any], hardware: Hardware
) -> str | None:
    """max_batch_size -> max_requests_per_batch: each request in a batch takes at least one
    of its max_batch_tokens, and transformers would lower a larger value silently."""
    tokens = options["max_prefill_token_num"]
    if value > tokens:
        return (
            f"at most max_prefill_token_num ({tokens}): each request in a batch takes one "
            "of its tokens"
        )
    return None


def refuse_lora(
    value: dict[str, str], options: Mapping[str, Any], hardware: Hardware
) -> str | None:
    """lora: this backend serves no LoRA adapters."""
    if value:
        return (
            "the transformers backend does not serve LoRA adapters: use --backend torch, or "
            "turbo on the CPU (batched adapters, chosen per request), or merge one into the "
            "weights (PEFT's merge_and_unload)"
        )
    return None


def refuse_quantization(value: str, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """quantization: this backend runs the checkpoint's weights as they are."""
    if value == "gguf":
        return (
            "the transformers backend dequantizes a GGUF file's blocks at load: use "
            "quantization none, or --backend turbo to run the blocks themselves"
        )
    if value != "none":
        other = "--backend turbo (CPU) for int4" if value == "int4" else "--backend torch for int8"
        return (
            f"the transformers backend does not quantize weights at load: use {other} "
            "weights, or quantization none"
        )
    return None


def refuse_weight_groups(value: Any, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """quantization_group_size / quantization_zero_point: nothing is quantized here."""
    if value:
        return (
            "the transformers backend does not quantize weights at load: group-wise "
            "weights (int4, int8 with a group size) run on --backend turbo (CPU)"
        )
    return None


def refuse_kv_cache_dtype(value: str, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """kv_cache_dtype: transformers' paged cache holds the model's dtype."""
    if value != "auto":
        return (
            "transformers' paged cache holds keys and values in the model's dtype: use "
            "--backend torch for an int8 or fp8 cache, or kv_cache_dtype auto"
        )
    return None


RULES = (
    OptionRule("cache_block_seq_len", "at least 4 (default 256)", refuse_small_page),
    OptionRule("quantization", "`none` only", refuse_quantization),
    OptionRule("quantization_group_size", "not supported", refuse_weight_groups),
    OptionRule("quantization_zero_point", "not supported", refuse_weight_groups),
    OptionRule("kv_cache_dtype", "`auto` only", refuse_kv_cache_dtype),
    OptionRule("max_batch_size", "at most max_prefill_token_num", refuse_batch_over_tokens),
    OptionRule("lora", "not supported", refuse_lora),
    OptionRule(
        "cuda_graphs",
        "on CUDA, transformers captures graphs where its decode path supports them; "
        "ignored on the CPU",
        lambda value, options, hardware: None,
        note=cuda_graphs_note,
    ),
    TORCH_THREADS_RULE,
    DEVICE_RULE,
    no_speculation_rule("transformers"),
    *one_device_rules("transformers"),
)
