"""Registers the ``openai-proxy`` backend and its options with llmctl.

This module is imported every time ``llmctl`` starts, so it stays light: httpx and the
engine are imported inside the methods that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.options import ENGINE_COMMANDS, Option
from llmctl.plugins import hookimpl

OPTIONS = (
    Option(
        "proxy_url",
        "str",
        None,
        "openai-proxy backend: URL of the OpenAI-compatible server to forward to, e.g. "
        "http://127.0.0.1:8000 (`/v1` is added unless the URL ends with it).",
        commands=ENGINE_COMMANDS,
        metavar="URL",
    ),
    Option(
        "proxy_api_key",
        "str",
        None,
        "openai-proxy backend: API key sent upstream as `Authorization: Bearer KEY`. "
        "Prefer the environment variable: flags and profiles are easy to leak.",
        commands=ENGINE_COMMANDS,
        metavar="KEY",
        secret=True,
    ),
    Option(
        "proxy_timeout",
        "float",
        600.0,
        "openai-proxy backend: seconds to wait for the upstream's next bytes (the first "
        "token of a long prompt included) before failing the request.",
        commands=ENGINE_COMMANDS,
        min=0.001,
        metavar="SECONDS",
    ),
    Option(
        "proxy_connect_timeout",
        "float",
        5.0,
        "openai-proxy backend: seconds to wait for a connection to the upstream server.",
        commands=ENGINE_COMMANDS,
        min=0.001,
        metavar="SECONDS",
    ),
)


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy engine's settings, translated from the unified options."""

    api_root: str  # e.g. http://127.0.0.1:8000/v1
    api_key: str | None = field(default=None, repr=False)  # never in logs or tracebacks
    timeout: float = 600.0
    connect_timeout: float = 5.0
    served_model_name: str | None = None
    session_len: int | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def api_root(proxy_url: str) -> str:
    """``http://host:8000`` and ``http://host:8000/v1/`` both mean ``http://host:8000/v1``."""
    root = proxy_url.strip().rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


class OpenAIProxyBackend(Backend):
    name = "openai-proxy"
    priority = 0  # below the local engines: `auto` tries it last, and only with a proxy_url
    description = "forwards generation to an OpenAI-compatible server (llmctl, vLLM, ...)"
    loads_local_model = False  # the model argument names a model on the upstream server

    def option_errors(self, options: Mapping[str, Any], hardware: Hardware) -> dict[str, str]:
        url = options.get("proxy_url")
        if url is None:
            return {}
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return {"proxy_url": "expected an http:// or https:// URL such as http://host:8000"}
        return {}

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
