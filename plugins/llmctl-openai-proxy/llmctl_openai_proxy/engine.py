"""``ProxyEngine``: the ``Engine`` surface (llmctl/backend.py) over a remote OpenAI API.

Each request streams from the upstream in a task of its own that feeds a queue the
``generate`` iterator reads. Aborting a request cancels that task, which closes its
upstream connection, so the upstream server stops generating for it too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from llmctl.backend import EngineStats, GenerationOutput, GenerationRequest
from llmctl.errors import InvalidRequest, UpstreamError
from llmctl.model.info import DEFAULT_MODEL, DEMO_NAME
from llmctl_openai_proxy.config import ProxyConfig
from llmctl_openai_proxy.protocol import StreamTranslator, sse_data, upstream_request
from llmctl_openai_proxy.upstream import list_models, status_error, transport_error

log = logging.getLogger("llmctl")


def create_proxy_engine(model: str, config: ProxyConfig) -> ProxyEngine:
    """Ask the upstream what it serves, pick the model and build the engine.

    ``model`` names a model of the upstream; the default model (``smollm2-135m``, or
    ``demo``), unless the upstream lists it, means "whatever the upstream serves first",
    so `llmctl serve --backend openai-proxy --proxy-url URL` just works in front of a
    single-model server.
    """
    cards = list_models(config)
    ids = [card["id"] for card in cards]
    if model in ids or model not in (DEFAULT_MODEL, DEMO_NAME):
        upstream_model = model
    elif ids:
        upstream_model = ids[0]
    else:
        raise UpstreamError(
            f"upstream {config.api_root} lists no models: name the one to use, e.g. "
            "`llmctl serve MODEL --backend openai-proxy --proxy-url URL`"
        )
    card = next((c for c in cards if c["id"] == upstream_model), {})
    if not card:  # some servers answer for names they do not list: let the upstream decide
        log.warning("upstream %s does not list %s (it lists %s)", config.api_root, model, ids)
    max_model_len = config.session_len or context_length(card)
    log.info(
        "forwarding to %s, model %s (context %s tokens)",
        config.api_root,
        upstream_model,
        max_model_len or "unknown",
    )
    served_name = config.served_model_name or upstream_model
    return ProxyEngine(config, upstream_model, served_name, max_model_len)


def context_length(card: dict[str, Any]) -> int:
    """The context length a model card states (vLLM and llmctl: ``max_model_len``), or 0."""
    for key in ("max_model_len", "context_length", "context_window"):
        if isinstance(card.get(key), int):
            return card[key]
    return 0


class ProxyEngine:
    def __init__(
        self, config: ProxyConfig, upstream_model: str, model_name: str, max_model_len: int
    ) -> None:
        self.config = config
        self.upstream_model = upstream_model
        self.model_name = model_name
        self.max_model_len = max_model_len  # 0: unknown; the upstream checks lengths itself
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._in_flight: dict[str, asyncio.Task] = {}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream the upstream's answer; leaving early closes the upstream request."""
        request_id = request.request_id
        if request_id in self._in_flight:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        path, body = upstream_request(request, self.upstream_model)
        outputs: asyncio.Queue[GenerationOutput | BaseException] = asyncio.Queue()
        translator = StreamTranslator(request_id, chat=request.messages is not None)
        forward = asyncio.create_task(self._forward(path, body, translator, outputs.put_nowait))
        self._in_flight[request_id] = forward
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._in_flight.get(request_id) is forward:
                del self._in_flight[request_id]
            forward.cancel()

    async def abort(self, request_id: str) -> None:
        """End a request with finish_reason ``abort``; returns once its upstream
        connection is closed."""
        forward = self._in_flight.get(request_id)
        if forward is not None:
            forward.cancel()
            await asyncio.wait([forward])

    def stats(self) -> EngineStats:
        # The KV cache lives upstream: only the requests in flight are known here.
        return EngineStats(running=len(self._in_flight))

    async def shutdown(self) -> None:
        for request_id in list(self._in_flight):
            await self.abort(request_id)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _forward(
        self, path: str, body: dict[str, Any], translator: StreamTranslator, emit
    ) -> None:
        """Stream one upstream request into ``emit``: outputs, then the final one or an
        error; an abort (cancellation) emits a final ``abort`` output."""
        try:
            async with self._http().stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise status_error(self.config, response.status_code, response.text)
                async for payload in sse_data(response.aiter_lines()):
                    if payload.strip() == "[DONE]":
                        break
                    if (output := translator.feed(payload)) is not None:
                        emit(output)
            emit(translator.finish())
        except asyncio.CancelledError:
            emit(translator.aborted())
            raise
        except httpx.HTTPError as exc:
            emit(transport_error(self.config, exc))
        except Exception as exc:  # handed to the reader, which raises it in its own task
            emit(exc)

    def _http(self) -> httpx.AsyncClient:
        """The connection pool of the running event loop (a pool cannot outlive its loop,
        and callers such as a synchronous API may run a fresh loop per call)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                base_url=self.config.api_root,
                headers=self.config.headers(),
                timeout=httpx.Timeout(self.config.timeout, connect=self.config.connect_timeout),
                # The server in front bounds concurrency; the pool must not add a lower cap.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            )
            self._client_loop = loop
        return self._client
