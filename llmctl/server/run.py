"""Run the app under uvicorn, on a socket bound before serving, with a graceful stop.

SIGINT/SIGTERM: the gate answers 503 to new requests at once, uvicorn stops accepting
connections and lets in-flight requests finish for up to ``shutdown_timeout`` seconds,
cancels what is left, then the app's lifespan shuts the engine down. An engine that
stops by itself (a fault it cannot recover from) starts the same drain, and
``run_server`` then raises, so ``llmctl serve`` exits with an error.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from types import FrameType
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmctl.backend import capabilities
from llmctl.errors import EngineError, OptionError
from llmctl.server.state import ServerState

log = logging.getLogger("llmctl.server")


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which also tells the app to refuse new work on a signal, and
    drains and stops when the engine has stopped."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn ticks every 0.1 s; the engine's health is read once a second.
        state = self.state
        if counter % 10 == 0 and not state.draining and not state.engine_alive():
            log.error("the inference engine has stopped; draining requests, then exiting")
            state.engine_failed = state.draining = True
            self.should_exit = True
        return await super().on_tick(counter)


class _HeadTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's head.

    uvicorn waits for a request line and headers for ever, so a client that sends a
    byte a minute (slowloris) holds a connection as long as it likes. Here a client
    has ``head_timeout`` seconds from connecting, or from the end of the previous
    response, to start a request; a connection still waiting then is closed. (The body
    has its own deadline in the gate, which answers 408.)
    """

    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout = head_timeout
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self._head_timeout, self._head_too_late)

    def _head_too_late(self) -> None:
        in_progress = self.cycle is not None and not self.cycle.response_complete
        if not in_progress and not self.transport.is_closing():
            log.warning("closing a connection that sent no request in %gs", self._head_timeout)
            if self.conn.our_state is not h11.ERROR:
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), ready for uvicorn to listen."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise OptionError(f"host {host!r} cannot be resolved ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OptionError(
            f"cannot listen on {host}:{port}: {exc.strerror}. Choose another --port "
            "(0 picks a free one) or stop the process using it"
        ) from None
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def run_server(
    app: FastAPI,
    sock: socket.socket,
    *,
    shutdown_timeout: float,
    tls: dict[str, Any] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; returns after the graceful shutdown.

    ``tls``: uvicorn's ``ssl_*`` settings (from ``tls.tls_settings``), to serve HTTPS.

    Raises ``EngineError`` when the server stopped because its engine did.
    """
    state: ServerState = app.state.llmctl
    config = uvicorn.Config(
        app,
        http=functools.partial(_HeadTimeoutProtocol, head_timeout=state.config.client_timeout),
        timeout_graceful_shutdown=shutdown_timeout,
        log_level="info",
        lifespan="on",
        server_header=False,
        **(tls or {}),
    )
    _DrainingServer(config, state).run(sockets=[sock])
    if state.engine_failed:
        cause = capabilities(state.engine).failure  # a tensor-parallel rank lost, say
        raise EngineError(
            "the inference engine failed and the server has stopped"
            + (f": {cause}" if cause else "; its cause is in the log above")
        )
