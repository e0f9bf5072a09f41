"""The proxy engine's settings in its own names, the options it adds, and its rules.

Light on purpose (imported whenever ``llmctl`` starts): no httpx.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from llmctl.backend import Hardware, OptionRule
from llmctl.options import ENGINE_COMMANDS, Option

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


def refuse_non_http_url(value: Any, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "expected an http:// or https:// URL such as http://host:8000"
    return None


RULES = (OptionRule("proxy_url", "an http:// or https:// URL", refuse_non_http_url),)
