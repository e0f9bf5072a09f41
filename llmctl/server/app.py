"""The FastAPI app: one engine behind the OpenAI API, with its gate, metrics and health."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline

from llmctl import __version__
from llmctl.backend import Engine
from llmctl.server.auth import ApiKeys
from llmctl.server.docs import install_redoc
from llmctl.server.errors import install_error_handlers
from llmctl.server.guard import Guard
from llmctl.server.limits import Admission
from llmctl.server.metrics import CONTENT_TYPE, ServerMetrics
from llmctl.server.openapi import Health, Version, install_openapi
from llmctl.server.routes_lora import router as lora_router
from llmctl.server.routes_openai import router
from llmctl.server.routes_tokenize import router as tokenize_router
from llmctl.server.state import ServerConfig, ServerState
from llmctl.server.stats import router as stats_router
from llmctl.server.web import install_web_ui
from llmctl.server.web.csp import ContentSecurityPolicy


def create_app(
    engine: Engine,
    *,
    backend_name: str,
    config: ServerConfig = ServerConfig(),
) -> FastAPI:
    """Build the app. The engine is shut down when the app's lifespan ends."""
    admission = Admission(config.max_concurrent_requests, config.max_queued_requests)
    state = ServerState(
        engine=engine,
        backend_name=backend_name,
        api_keys=ApiKeys(config.api_keys),
        admission=admission,
        metrics=ServerMetrics(engine, admission),
        config=config,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    # /docs and /redoc load Swagger UI and ReDoc from the package, not from a CDN.
    app = FastAPIOffline(title="llmctl", version=__version__, lifespan=lifespan, redoc_url=None)
    install_redoc(app)
    app.state.llmctl = state
    app.add_middleware(Guard, state=state)
    app.add_middleware(ContentSecurityPolicy)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(stats_router)
    app.include_router(tokenize_router)
    app.include_router(lora_router)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> Response:
        """200 while the engine runs; 503 while shutting down or once the engine stopped."""
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not state.engine_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version", response_model=Version)
    async def version() -> dict[str, str]:
        return {"version": __version__, "backend": state.backend_name}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    if config.web_ui:
        install_web_ui(app)
    install_openapi(app, state)
    return app
