"""Registers the ``openai-proxy`` backend and its options with llmctl.

This module is imported every time ``llmctl`` starts, so it stays light: httpx and the
engine are imported inside the methods that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.plugins import hookimpl
from llmctl_openai_proxy.config import OPTIONS, RULES, ProxyConfig, api_root


class OpenAIProxyBackend(Backend):
    name = "openai-proxy"
    priority = 0  # below the local engines: `auto` tries it last, and only with a proxy_url
    description = "forwards generation to an OpenAI-compatible server (llmctl, vLLM, ...)"
    loads_local_model = False  # the model argument names a model on the upstream server
    rules = RULES

    def check(self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware) -> list[str]:
        reasons = super().check(model, options, hardware)
        if options.get("proxy_url") is None:
            reasons.append(
                "no upstream server given: pass --proxy-url URL (or set proxy_url in a "
                "profile, or LLMCTL_PROXY_URL) naming an OpenAI-compatible server"
            )
        elif not reasons:
            from llmctl_openai_proxy.upstream import probe

            problem = probe(self.translate(options))
            if problem:
                reasons.append(problem)
        return reasons

    def translate(self, options: Mapping[str, Any]) -> ProxyConfig:
        return ProxyConfig(
            api_root=api_root(options["proxy_url"]),
            api_key=options["proxy_api_key"],
            timeout=options["proxy_timeout"],
            connect_timeout=options["proxy_connect_timeout"],
            served_model_name=options["model_name"],
            session_len=options["session_len"],
        )

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        from llmctl_openai_proxy.engine import create_proxy_engine

        return create_proxy_engine(model.name, self.translate(options))


@hookimpl
def llmctl_register_backends(register) -> None:
    register(OpenAIProxyBackend)


@hookimpl
def llmctl_register_options(register) -> None:
    for option in OPTIONS:
        register(option)
