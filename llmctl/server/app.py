"""The FastAPI app: one engine behind the OpenAI API, with its gate, metrics and health."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from llmctl import __version__
from llmctl.backend import Engine
from llmctl.server.auth import ApiKeys
from llmctl.server.errors import APIError, install_error_handlers
from llmctl.server.guard import Guard
from llmctl.server.limits import Admission
from llmctl.server.metrics import CONTENT_TYPE, ServerMetrics

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass
class ServerState:
    """Everything the routes share. ``draining`` turns on at SIGINT/SIGTERM."""

    engine: Engine
    backend_name: str
    api_keys: ApiKeys
    admission: Admission
    metrics: ServerMetrics
    log_prompts: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    draining: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))

    def engine_alive(self) -> bool:
        """Engines may offer ``is_alive()`` (their background loop still runs); one that
        does not is taken to be alive while it answers."""
        is_alive = getattr(self.engine, "is_alive", None)
        return bool(is_alive()) if callable(is_alive) else True

    def check_model(self, requested: str | None) -> None:
        served = self.engine.model_name
        if requested is not None and requested != served:
            raise APIError(
                404,
                f"the model {requested!r} does not exist here: this server serves "
                f"{served!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )


def create_app(
    engine: Engine,
    *,
    backend_name: str,
    api_keys: Iterable[str] | None = None,
    max_concurrent_requests: int = 64,
    max_queued_requests: int = 256,
    log_prompts: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Build the app. The engine is shut down when the app's lifespan ends."""
    from llmctl.server.routes_openai import router

    admission = Admission(max_concurrent_requests, max_queued_requests)
    state = ServerState(
        engine=engine,
        backend_name=backend_name,
        api_keys=ApiKeys(api_keys),
        admission=admission,
        metrics=ServerMetrics(engine, admission),
        log_prompts=log_prompts,
        max_body_bytes=max_body_bytes,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = FastAPI(title="llmctl", version=__version__, lifespan=lifespan)
    app.state.llmctl = state
    app.add_middleware(Guard, state=state)
    install_error_handlers(app)
    app.include_router(router)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not state.engine_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__, "backend": state.backend_name}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app
