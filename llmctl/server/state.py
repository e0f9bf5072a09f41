"""What every part of the server shares: the engine, the gate's settings, the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from llmctl.backend import Engine, capabilities
from llmctl.server.auth import ApiKeys
from llmctl.server.errors import APIError
from llmctl.server.limits import Admission
from llmctl.server.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_CLIENT_TIMEOUT = 30.0


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
    log_prompts: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT
    settings: dict[str, Any] = field(default_factory=dict)  # the options /stats shows
    tool_call_parser: str = "auto"  # a tool_parsers family, or auto: from the template
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
