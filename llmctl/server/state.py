"""What every part of the server shares: the engine, the gate's settings, the limits."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmctl.backend import Engine, capabilities
from llmctl.server.auth import ApiKeys
from llmctl.server.errors import APIError
from llmctl.server.limits import Admission
from llmctl.server.metrics import ServerMetrics

# The options that tell what a server is, as the /stats panel shows them.
SHOWN_OPTIONS = (
    "cache_block_seq_len",
    "cache_max_entry_count",
    "session_len",
    "max_batch_size",
    "quantization",
    "kv_cache_dtype",
    "dtype",
    "device",
    "enable_prefix_caching",
    "tensor_parallel_size",
)


@dataclass(frozen=True)
class ServerConfig:
    """How the server admits and treats requests, built once from the options."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_concurrent_requests: int = 64
    max_queued_requests: int = 256
    log_prompts: bool = False
    max_body_bytes: int = 8 * 2**20
    client_timeout: float = 30.0  # seconds a client may take to send or read
    web_ui: bool = True  # serve the chat page at /
    settings: Mapping[str, Any] = field(default_factory=dict)  # the options /stats shows
    tool_call_parser: str = "auto"  # a tool_parsers family, or auto: from the template

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ServerConfig:
        """The one place the unified option names map to the server's."""
        return cls(
            api_keys=tuple(options["api_keys"] or ()),
            max_concurrent_requests=options["max_concurrent_requests"],
            max_queued_requests=options["max_queued_requests"],
            log_prompts=options["log_prompts"],
            client_timeout=options["client_timeout"],
            web_ui=options["web_ui"],
            settings={name: _as_json(options.get(name)) for name in SHOWN_OPTIONS},
            tool_call_parser=options["tool_call_parser"],
        )


def _as_json(value: Any) -> Any:
    """An option's value as JSON shows it (a KV budget as its text)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


@dataclass
class ServerState:
    """Everything the routes and the gate share.

    ``draining`` turns on at SIGINT/SIGTERM, or when the engine stops by itself; the
    latter also sets ``engine_failed``, so ``serve`` exits with an error afterwards.
    """

    engine: Engine
    backend_name: str
    api_keys: ApiKeys
    admission: Admission
    metrics: ServerMetrics
    config: ServerConfig
    draining: bool = False
    engine_failed: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))

    def engine_alive(self) -> bool:
        """Whether the engine can still serve (``EngineCapabilities.is_alive``)."""
        return capabilities(self.engine).is_alive()

    def chat_template(self) -> str | None:
        """The served model's chat template, where the engine has one here (a local one)."""
        tokenizer = capabilities(self.engine).tokenizer
        return None if tokenizer is None else tokenizer.chat_template

    def check_model(self, requested: str | None) -> str | None:
        """The LoRA adapter ``requested`` names (None: the base model); 404 for neither."""
        served = self.engine.model_name
        if requested is None or requested == served:
            return None
        adapters = capabilities(self.engine).lora_names()
        if requested in adapters:
            return requested
        also = f" and LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise APIError(
            404,
            f"the model {requested!r} does not exist here: this server serves "
            f"{served!r}{also} (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )
