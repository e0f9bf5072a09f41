"""Registers the ``transformers`` backend with llmctl.

This module is imported every time ``llmctl`` starts, so it stays light: transformers
(which imports torch, seconds of work) is imported only inside the methods that need it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.plugins import hookimpl
from llmctl_transformers.config import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_PAGE_SIZE,
    RULES,
    TransformersConfig,
)

# The first transformers with this continuous-batching API (page_size replaced block_size;
# find_head_dim and find_num_key_value_heads in its utils), as pyproject.toml declares:
# tests/plugins/test_transformers_oldest.py runs the plugin's tests against it.
MIN_TRANSFORMERS = (5, 18)


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
    rules = RULES
    supported_architectures = _CausalLMArchitectures()
    last_resort = True  # slower than the native engines: never taken for an option value

    def check_hardware(self, hardware: Hardware) -> list[str]:
        wanted = ".".join(map(str, MIN_TRANSFORMERS))
        if importlib.util.find_spec("transformers") is None:
            return [f"transformers is not installed (pip install 'transformers>={wanted}')"]
        version = importlib.metadata.version("transformers")
        if _release(version) < MIN_TRANSFORMERS:
            return [
                f"transformers {version} is too old for this backend: it needs the "
                f"continuous-batching API of transformers >= {wanted} "
                f"(pip install 'transformers>={wanted}')"
            ]
        return []

    def check(self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware) -> list[str]:
        # Backend.check, but with a reason of transformers' own for the architecture (the
        # base class's would list every class transformers has).
        missing = self.check_hardware(hardware)
        reasons = missing + model.problems  # problems: a broken model directory
        if not missing:  # transformers is here to ask
            from llmctl_transformers.support import architecture_problem, gguf_problem

            for problem in (
                architecture_problem(model.config),
                gguf_problem(model.path, model.config),
            ):
                if problem is not None:
                    reasons.append(problem)
        for option, rule in self.option_errors(options, hardware).items():
            reasons.append(f"{option}={options[option]!r} refused: {rule}")
        return reasons

    def translate(self, options: Mapping[str, Any]) -> TransformersConfig:
        return TransformersConfig.from_options(options)

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
