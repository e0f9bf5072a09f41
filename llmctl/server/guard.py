"""The gate in front of every API route, as plain ASGI middleware.

In order: count the answer's status for /metrics; refuse new work while shutting down
(503) or when the engine has died (503); check the API key (401); read the body up to
the size limit (413) and within the client timeout (408) before anything parses it.
/health, /version and /metrics are outside the gate: always open, never counted.
"""

from __future__ import annotations

import anyio
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmctl.server.errors import APIError
from llmctl.server.state import ServerState

GUARDED_PREFIX = "/v1/"
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})  # vLLM's paths, outside /v1
# Metrics label paths by name only for the real routes, so random URLs cannot create
# an unbounded number of time series.
KNOWN_ENDPOINTS = frozenset(
    {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        *GUARDED_PATHS,
    }
)


class Guard:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if not (path.startswith(GUARDED_PREFIX) or path in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        send = self._counting(scope["path"], send)
        error = self._refusal(Headers(scope=scope))
        if error is None:
            receive, error = await self._read_body(scope, receive)
        if error is not None:
            await error.send(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _counting(self, path: str, send: Send) -> Send:
        requests = self.state.metrics.requests
        endpoint = path if path in KNOWN_ENDPOINTS else "other"

        async def send_and_count(message: Message) -> None:
            if message["type"] == "http.response.start":
                requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        return send_and_count

    def _refusal(self, headers: Headers) -> APIError | None:
        state = self.state
        if state.draining:
            return APIError(
                503,
                "the server is shutting down and accepts no new requests",
                type="server_error",
                code="server_shutting_down",
            )
        if not state.engine_alive():
            return APIError(
                503,
                "the inference engine has stopped; restart the server (see its log)",
                type="server_error",
                code="engine_dead",
            )
        if not state.api_keys.allows(headers.get("authorization")):
            return APIError(
                401,
                "a valid API key is required: send the header `Authorization: Bearer KEY`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[Receive, APIError | None]:
        """Buffer the body up to the limit; hand the app a receive that replays it.

        Both refusals close the connection: the rest of the body is not worth reading.
        """
        limit, timeout = self.state.config.max_body_bytes, self.state.config.client_timeout
        too_large = APIError(
            413,
            f"the request body is larger than the limit of {limit} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return receive, too_large
        chunks, size, more = [], 0, True
        with anyio.move_on_after(timeout) as deadline:
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return receive, None  # the route will see the disconnect and stop
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return receive, too_large
                chunks.append(chunk)
                more = message.get("more_body", False)
        if deadline.cancelled_caught:
            return receive, APIError(
                408,
                f"the request body did not arrive within {timeout:g} s (the server's "
                "client_timeout); send it faster or in one piece",
                code="request_timeout",
                headers={"Connection": "close"},
            )
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay, None
