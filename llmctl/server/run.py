"""Run the app under uvicorn, on a socket bound before serving, with a graceful stop.

SIGINT/SIGTERM: the gate answers 503 to new requests at once, uvicorn stops accepting
connections and lets in-flight requests finish for up to ``shutdown_timeout`` seconds,
cancels what is left, then the app's lifespan shuts the engine down.
"""

from __future__ import annotations

import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from llmctl.errors import OptionError
from llmctl.server.app import ServerState


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which also tells the app to refuse new work on a signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    engine_stopped = False  # the engine died while serving (see on_tick)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Checked every 0.1 s: an engine that died on its own (a tensor-parallel rank was
        lost) stops the server, which then exits non-zero."""
        if not self.state.draining and not self.state.engine_alive():
            self.engine_stopped = True
            return True
        return await super().on_tick(counter)


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


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(app: FastAPI, sock: socket.socket, *, shutdown_timeout: float) -> bool:
    """Serve until SIGINT/SIGTERM or until the engine dies; returns after the graceful
    shutdown, True if the engine died."""
    config = uvicorn.Config(
        app,
        timeout_graceful_shutdown=shutdown_timeout,
        log_level="info",
        lifespan="on",
        server_header=False,
    )
    server = _DrainingServer(config, app.state.llmctl)
    server.run(sockets=[sock])
    return server.engine_stopped
