"""``GET /stats``: the server's settings and live figures as one JSON object.

The chat page's server panel reads it every second or so. Figures that grow (tokens,
time to first token) are totals since the start, with the server's clock, so each
reader turns two readings into rates itself: several pages can watch one server
without the server keeping state for any of them. It names the model and the
server's options, so it takes the API key like the /v1 routes.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from llmctl.server.errors import APIError
from llmctl.server.openapi import error_responses
from llmctl.server.state import ServerState

router = APIRouter()


class EngineFigures(BaseModel):
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_peak: int
    block_size: int


class Totals(BaseModel):
    prompt_tokens: float
    generation_tokens: float
    time_to_first_token_seconds_sum: float
    time_to_first_token_count: float


class Stats(BaseModel):
    backend: str
    model: str
    max_model_len: int | None
    settings: dict[str, Any]
    engine: EngineFigures
    http_generating: int
    http_queued: int
    totals: Totals
    time: float  # the server's monotonic clock in seconds: divide total deltas by its delta


@router.get("/stats", response_model=Stats, responses=error_responses(401))
async def stats(request: Request) -> dict[str, Any]:
    """Settings, the engine's load and totals since the start (see the module's doc)."""
    state: ServerState = request.app.state.llmctl
    if not state.api_keys.allows(request.headers.get("authorization")):
        raise APIError(
            401,
            "a valid API key is required: send the header `Authorization: Bearer KEY`",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    engine = state.engine.stats()
    sample = state.metrics.registry.get_sample_value
    return {
        "backend": state.backend_name,
        "model": state.engine.model_name,
        "max_model_len": state.engine.max_model_len or None,
        "settings": dict(state.config.settings),
        "engine": {
            "running": engine.running,
            "waiting": engine.waiting,
            "kv_blocks_total": engine.kv_blocks_total,
            "kv_blocks_used": engine.kv_blocks_used,
            "kv_blocks_peak": engine.kv_blocks_peak,
            "block_size": engine.block_size,
        },
        "http_generating": state.admission.running,
        "http_queued": state.admission.waiting,
        "totals": {
            "prompt_tokens": sample("llmctl_prompt_tokens_total") or 0.0,
            "generation_tokens": sample("llmctl_generation_tokens_total") or 0.0,
            "time_to_first_token_seconds_sum": (
                sample("llmctl_time_to_first_token_seconds_sum") or 0.0
            ),
            "time_to_first_token_count": sample("llmctl_time_to_first_token_seconds_count") or 0.0,
        },
        "time": time.monotonic(),
    }
