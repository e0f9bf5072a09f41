"""Overload and shutdown on a server of its own with tiny limits (1 running, 1 queued):
beyond the queue a 429 with Retry-After; SIGTERM lets the running stream finish. It also
runs with --log-prompts."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server
from tests.server.conftest import QUIET_THREADS, stories_or_skip

LONG = {
    "prompt": "Once upon a time",
    "max_tokens": 300,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    stories_or_skip()
    args = [str(STORIES), "--backend", "torch", "--max-concurrent-requests", "1"]
    args += ["--max-queued-requests", "1", "--shutdown-timeout", "60", "--log-prompts"]
    process = start_server(args, env=QUIET_THREADS)
    try:
        yield process
    finally:
        process.stop()


def gauge(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def read_stream(response: httpx.Response) -> list[dict]:
    """The JSON events of an SSE response, checking it ends with [DONE]."""
    data = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_beyond_the_queue_is_429_with_retry_after(small_server: ServerProcess) -> None:
    url = f"{small_server.url}/v1/completions"
    with httpx.Client(timeout=120) as running, httpx.Client(timeout=120) as queued:
        with running.stream("POST", url, json=LONG) as first:
            lines = first.iter_lines()  # (kept: dropping the iterator closes the stream)
            next(lines)  # generating: it holds the only slot
            waiting: dict = {}
            thread = threading.Thread(
                target=lambda: waiting.update(
                    response=queued.post(url, json={"prompt": "Tom", "max_tokens": 3})
                )
            )
            thread.start()
            wait_for(lambda: gauge(small_server, "llmctl_http_requests_queued") == 1)

            refused = httpx.post(url, json={"prompt": "Lily", "max_tokens": 3})
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "server_overloaded"
            assert "max_queued_requests=1" in error["message"]
        # the first stream was closed: the queued request gets the slot and completes
        thread.join(60)
        assert waiting["response"].status_code == 200
    ok = httpx.post(url, json={"prompt": "Lily", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200


def test_a_queued_client_that_leaves_frees_its_place(small_server: ServerProcess) -> None:
    url = f"{small_server.url}/v1/completions"
    address = urlsplit(small_server.url)
    body = json.dumps({"prompt": "Tom", "max_tokens": 3}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=LONG) as first:
        lines = first.iter_lines()
        next(lines)  # holds the only slot
        with socket.create_connection((address.hostname, address.port)) as sock:
            sock.sendall(request)
            wait_for(lambda: gauge(small_server, "llmctl_http_requests_queued") == 1)
        wait_for(lambda: gauge(small_server, "llmctl_http_requests_queued") == 0)
        assert gauge(small_server, "llmctl_http_requests_generating") == 1


def test_log_prompts_writes_prompt_and_text(small_server: ServerProcess) -> None:
    prompt = "The purple zebra whispered"
    response = httpx.post(
        f"{small_server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=60
    )
    text = response.json()["choices"][0]["text"]
    log = small_server.log()
    assert repr(prompt) in log and repr(text) in log


def test_sigterm_finishes_the_running_stream_then_exits(small_server: ServerProcess) -> None:
    url = f"{small_server.url}/v1/completions"
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=LONG) as response:
        lines = response.iter_lines()
        next(lines)
        small_server.process.send_signal(signal.SIGTERM)
        try:  # new work is refused: 503 while draining, then the port is closed
            late = httpx.post(url, json={"prompt": "Tom", "max_tokens": 3}, timeout=10)
            assert late.status_code == 503
            assert late.json()["error"]["code"] == "server_shutting_down"
        except httpx.TransportError:
            pass
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in rest[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    small_server.process.wait(60)
    assert small_server.process.returncode in (0, -signal.SIGTERM)
    log = small_server.log()
    assert "Traceback" not in log, log
