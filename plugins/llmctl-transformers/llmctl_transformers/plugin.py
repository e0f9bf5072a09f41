"""Registers the ``transformers`` backend with llmctl.

This module is imported every time ``llmctl`` starts, so it stays light: transformers
(which imports torch, seconds of work) is imported only inside the methods that need it.

``translate`` is the one place where llmctl's unified options become the names of
transformers' ``ContinuousBatchingConfig``; each value this backend refuses has a rule of
its own below (``RULES``), so ``llmctl backends check`` names the option and the rule.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.kv_budget import KVBudget, parse_kv_budget
from llmctl.plugins import hookimpl

# transformers' ContinuousBatchingConfig.page_size default: tokens per page of its paged cache.
DEFAULT_PAGE_SIZE = 256
# Tokens in one batch (prefill chunks and decodes): transformers' default is 8192, but with
# eager or SDPA attention (no flash attention: always on CPU) it allocates an attention mask
# of max_batch_tokens x (cache tokens + max_batch_tokens), which at 8192 dwarfs the cache.
DEFAULT_BATCH_TOKENS = 512
# transformers' own lower bound on page_size (BOUNDS["page_size"] in
# transformers/generation/continuous_batching/initialization.py; a test keeps them equal).
MIN_PAGE_SIZE = 4
# The first transformers with this continuous-batching API (page_size replaced block_size).
MIN_TRANSFORMERS = (5, 17)


@dataclass(frozen=True)
class TransformersConfig:
    """The engine's settings in transformers' own names (``ContinuousBatchingConfig``).

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
    dtype: str
    device: str
    seed: int
    max_model_len: int | None
    chat_template: str | None
    served_model_name: str | None

    @property
    def kv_budget(self) -> KVBudget:
        """The budget back in llmctl's form, to plan blocks as the other backends do."""
        if self.num_blocks is not None:
            return KVBudget("blocks", self.num_blocks)
        if self.max_memory_percent is not None:
            return KVBudget("fraction", self.max_memory_percent)
        return KVBudget("bytes", self.max_cache_bytes)


# One rule per option: each takes the resolved options and the machine, and returns why the
# value is refused (None: accepted).
Rule = Callable[[Mapping[str, Any], Hardware], "str | None"]


def page_size_rule(options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """cache_block_seq_len -> page_size: transformers' paged cache needs at least 4 tokens a page."""
    if options["cache_block_seq_len"] < MIN_PAGE_SIZE:
        return (
            f"transformers' paged cache needs pages of at least {MIN_PAGE_SIZE} tokens "
            f"(its default, and this backend's, is {DEFAULT_PAGE_SIZE})"
        )
    return None


def batch_size_rule(options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """max_batch_size -> max_requests_per_batch: at most max_prefill_token_num, since each
    request in a batch takes at least one of its max_batch_tokens (transformers would
    lower it silently)."""
    if options["max_batch_size"] > options["max_prefill_token_num"]:
        return (
            f"at most max_prefill_token_num ({options['max_prefill_token_num']}): each request "
            "in a batch takes at least one of its tokens"
        )
    return None


def adapters_rule(options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """adapters: this backend loads no LoRA adapters."""
    if options["adapters"]:
        return (
            "the transformers backend does not load LoRA adapters: merge them into the "
            "weights (PEFT's merge_and_unload) or use --backend torch"
        )
    return None


def device_rule(options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """device: 'cuda' needs a CUDA GPU here."""
    if options["device"] == "cuda" and not hardware.cuda_available:
        return "device 'cuda' asked for, but no CUDA GPU is available here"
    return None


RULES: dict[str, Rule] = {
    "cache_block_seq_len": page_size_rule,
    "max_batch_size": batch_size_rule,
    "adapters": adapters_rule,
    "device": device_rule,
}


class _CausalLMArchitectures:
    """``supported_architectures`` for this backend: the causal-LM classes the installed
    transformers implements, looked up on first use (importing transformers takes seconds,
    too long for every ``llmctl`` start)."""

    def __get__(self, instance: object, owner: type) -> frozenset[str]:
        from llmctl_transformers.support import causal_lm_architectures

        return causal_lm_architectures()


class TransformersBackend(Backend):
    name = "transformers"
    priority = 5  # below turbo (20) and torch (10): `auto` reaches it for what they cannot serve
    description = (
        "transformers' own continuous-batching engine: any causal LM transformers implements"
    )
    option_defaults = {
        "cache_block_seq_len": DEFAULT_PAGE_SIZE,
        "max_prefill_token_num": DEFAULT_BATCH_TOKENS,
    }
    supported_architectures = _CausalLMArchitectures()

    def check_hardware(self, hardware: Hardware) -> list[str]:
        if importlib.util.find_spec("transformers") is None:
            return ["transformers is not installed (pip install 'transformers>=5.17')"]
        version = importlib.metadata.version("transformers")
        if _release(version) < MIN_TRANSFORMERS:
            wanted = ".".join(map(str, MIN_TRANSFORMERS))
            return [
                f"transformers {version} is too old for this backend: it needs the "
                f"continuous-batching API of transformers >= {wanted} "
                f"(pip install 'transformers>={wanted}')"
            ]
        return []

    def option_errors(self, options: Mapping[str, Any], hardware: Hardware) -> dict[str, str]:
        errors = {}
        for option, rule in RULES.items():
            if (reason := rule(options, hardware)) is not None:
                errors[option] = reason
        return errors

    def check(self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware) -> list[str]:
        # Not Backend.check: its architecture reason would list every class transformers has.
        reasons = self.check_hardware(hardware)
        if not reasons:
            from llmctl_transformers.support import architecture_problem

            if (problem := architecture_problem(model.config)) is not None:
                reasons.append(problem)
        for option, rule in self.option_errors(options, hardware).items():
            reasons.append(f"{option}={options[option]!r} refused: {rule}")
        return reasons

    def translate(self, options: Mapping[str, Any]) -> TransformersConfig:
        budget = parse_kv_budget(options["cache_max_entry_count"])
        # cuda_graphs -> use_cuda_graph once llmctl has that option (DESIGN.md, second
        # wave); until then transformers decides (on for flash attention on CUDA).
        return TransformersConfig(
            page_size=options["cache_block_seq_len"],
            num_blocks=int(budget.value) if budget.kind == "blocks" else None,
            max_memory_percent=budget.value if budget.kind == "fraction" else None,
            max_cache_bytes=int(budget.value) if budget.kind == "bytes" else None,
            max_batch_tokens=options["max_prefill_token_num"],
            max_requests_per_batch=options["max_batch_size"],
            allow_block_sharing=options["enable_prefix_caching"],
            dtype=options["dtype"],
            device=options["device"],
            seed=options["seed"],
            max_model_len=options["session_len"],
            chat_template=options["chat_template"],
            served_model_name=options["model_name"],
        )

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        from llmctl_transformers.engine import create_transformers_engine

        return create_transformers_engine(model, self.translate(options), hardware)


def _release(version: str) -> tuple[int, ...]:
    """``"5.24.0.dev0"`` -> ``(5, 24)``: the major and minor numbers of a version string."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@hookimpl
def llmctl_register_backends(register) -> None:
    register(TransformersBackend)
