"""Slow clients are timed out (``--client-timeout``), on a server of its own with a
1-second limit: a request head that never ends, a body that never arrives, a stream
nobody reads. Each test waits for an outcome (a closed socket, a 408, a freed slot),
never for a time."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server
from tests.server.conftest import QUIET_THREADS, stories_or_skip

CLIENT_TIMEOUT = 1


@pytest.fixture(scope="module")
def strict_server() -> Iterator[ServerProcess]:
    stories_or_skip()
    args = [str(STORIES), "--backend", "torch", "--client-timeout", str(CLIENT_TIMEOUT)]
    server = start_server(args, env=QUIET_THREADS)
    try:
        yield server
    finally:
        server.stop()


def connect(server: ServerProcess, receive_buffer: int | None = None) -> socket.socket:
    address = urlsplit(server.url)
    sock = socket.socket()
    if receive_buffer is not None:  # before connecting, so the TCP window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(60)  # only a safety net: the server closes long before
    sock.connect((address.hostname, address.port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def request_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def gauge(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_request_head_that_never_ends_is_disconnected(strict_server: ServerProcess) -> None:
    with connect(strict_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")  # no blank line
        assert read_until_closed(sock) == b""  # closed without an answer
    assert httpx.get(f"{strict_server.url}/health").status_code == 200


def test_a_body_that_does_not_arrive_gets_408(strict_server: ServerProcess) -> None:
    with connect(strict_server) as sock:
        sock.sendall(request_head("/v1/completions", 100) + b'{"prompt": ')
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "client_timeout" in error["message"]


def test_a_stream_nobody_reads_is_dropped_and_frees_its_slot(strict_server: ServerProcess) -> None:
    # About 10 MB of events (16 choices x 500 tokens x 20 alternatives each), far more
    # than the socket buffers hold, so the server's writes stall.
    body = json.dumps(
        {"prompt": "Once", "max_tokens": 500, "n": 16, "logprobs": 20, "ignore_eos": True}
        | {"stream": True}
    ).encode()
    with connect(strict_server, receive_buffer=4096) as sock:
        sock.sendall(request_head("/v1/completions", len(body)) + body)
        deadline = time.monotonic() + 120
        while gauge(strict_server, "llmctl_http_requests_generating") != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.1)
        while gauge(strict_server, "llmctl_http_requests_generating") != 0:
            assert time.monotonic() < deadline, "a stalled stream kept its generation slot"
            time.sleep(0.1)
        received = read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in received  # cut off, not finished
    assert gauge(strict_server, "llmctl_kv_blocks_used") == 0
    assert "stream dropped" in strict_server.log()
