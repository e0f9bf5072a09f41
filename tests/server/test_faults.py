"""Faults inside the model call, injected into a real backend's real step
(``LLMCTL_TEST_FAULT``): one failed step fails only its requests with a 500
``engine_error`` and the server goes on; a model that keeps failing stops the engine,
/health turns 503 and ``llmctl serve`` exits with an error."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server
from tests.server.conftest import QUIET_THREADS, stories_or_skip

GREEDY = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def serve_with_fault(backend: str, fault: str) -> ServerProcess:
    stories_or_skip()
    if backend == "turbo" and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build turbo's native ops")
    env = {**QUIET_THREADS, "LLMCTL_TEST_FAULT": fault}
    return start_server([str(STORIES), "--backend", backend], env=env)


def kv_blocks_used(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("llmctl_kv_blocks_used "):
            return float(line.split()[1])
    raise AssertionError("llmctl_kv_blocks_used not in /metrics")


@pytest.mark.parametrize("backend", ["torch", "turbo"])
def test_a_failed_model_call_fails_its_requests_and_the_server_goes_on(backend: str) -> None:
    # Model calls: 1 fails (the first request's prefill); 2 and 3 give the streamed
    # request two tokens; 4 fails in the middle of its stream; then all goes well.
    server = serve_with_fault(backend, "model_call:1,4")
    try:
        url = f"{server.url}/v1/completions"
        failed = httpx.post(url, json=GREEDY, timeout=60)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_error")
        assert "model call 1" in error["message"]

        with httpx.stream("POST", url, json={**GREEDY, "stream": True}, timeout=60) as stream:
            data = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        events = [json.loads(item) for item in data[:-1]]
        assert [len(event["choices"]) for event in events[:-1]] == [1, 1]  # two tokens
        assert events[-1]["error"]["code"] == "engine_error"

        answer = httpx.post(url, json=GREEDY, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert kv_blocks_used(server) == 0
        log = server.log()
        assert log.count("the model call failed") == 2
        assert "InjectedFault: fault injected by LLMCTL_TEST_FAULT into model call 4" in log
    finally:
        server.stop()


def test_a_model_that_keeps_failing_stops_the_engine_and_the_server() -> None:
    server = serve_with_fault("torch", "model_call:1+")
    try:
        url = f"{server.url}/v1/completions"
        for _ in range(3):  # the engine gives up after 3 failed steps in a row
            failed = httpx.post(url, json=GREEDY, timeout=60)
            assert failed.status_code == 500, failed.text
            assert failed.json()["error"]["code"] == "engine_error"
        assert "has stopped" in failed.json()["error"]["message"]
        try:  # the port closes once the server has drained
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 503
            refused = httpx.post(url, json=GREEDY, timeout=10)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] in ("engine_dead", "server_shutting_down")
        except httpx.TransportError:
            pass
        assert server.process.wait(60) == 1
        log = server.log()
        assert "3 model calls failed in a row" in log
        assert "Error: the inference engine failed and the server has stopped" in log
    finally:
        server.stop()
