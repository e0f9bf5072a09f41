"""A client that goes away mid-generation frees its KV blocks (seen through /metrics)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from tests.server.conftest import Server

ABORTED = 'llmctl_request_finished_total{reason="abort"}'
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def wait_for(condition: Callable[[], bool], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def idle_blocks(server: Server) -> float:
    assert wait_for(lambda: server.metric("llmctl_num_requests_running") == 0)
    return server.metric("llmctl_kv_blocks_used")


def test_closing_a_stream_aborts_and_frees_blocks(server: Server) -> None:
    before = idle_blocks(server)
    aborted = server.metric(ABORTED, default=0)
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            events = response.iter_lines()
            received = [line for line, _ in zip(events, range(6)) if line.startswith("data:")]
            assert len(received) >= 2
            assert server.metric("llmctl_kv_blocks_used") > before
        # leaving the block closes the connection mid-stream
    assert wait_for(lambda: server.metric("llmctl_kv_blocks_used") == before), (
        f"KV blocks used stayed at {server.metric('llmctl_kv_blocks_used')}, not {before}"
    )
    assert server.metric("llmctl_num_requests_running") == 0
    assert wait_for(lambda: server.metric(ABORTED, default=0) == aborted + 1)


def test_leaving_a_whole_response_aborts_and_frees_blocks(server: Server) -> None:
    before = idle_blocks(server)
    aborted = server.metric(ABORTED, default=0)
    address = urlsplit(server.url)
    body = json.dumps(LONG).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(request)
        assert wait_for(lambda: server.metric("llmctl_kv_blocks_used") > before)
    assert wait_for(lambda: server.metric("llmctl_kv_blocks_used") == before), (
        f"KV blocks used stayed at {server.metric('llmctl_kv_blocks_used')}, not {before}"
    )
    assert server.metric("llmctl_num_requests_running") == 0
    assert wait_for(lambda: server.metric(ABORTED, default=0) == aborted + 1)
