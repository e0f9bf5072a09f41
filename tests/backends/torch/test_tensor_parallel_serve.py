"""``llmctl serve --tp 2`` as users run it, on CPU with gloo over loopback.

One machine (rank 1 started by llmctl) and two "machines" (two ``llmctl serve``
processes on localhost with ``--nnodes 2``) give the reference greedy text; the option
rules name what they refuse; a rank killed or hung makes the server answer 503 and exit
non-zero naming the rank within 30 s; Ctrl-C and SIGTERM stop every rank. Process trees
are read from /proc: no process may outlive the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import STORIES
from tests.helpers.cli import run_llmctl
from tests.helpers.server_process import ServerProcess, free_port, start_server

FAILURE_DEADLINE_S = 30.0
# Loopback only, whatever the host name resolves to; one thread per rank (shared machine).
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    if not (STORIES / "reference_greedy.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    return json.loads((STORIES / "reference_greedy.json").read_text())["results"][:3]


def serve_args(*extra: str) -> list[str]:
    return [str(STORIES), "--backend", "torch", "--cache-block-seq-len", "16", *extra]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def rank_processes(pid: int) -> list[int]:
    """The rank processes llmctl spawned below ``pid``."""
    return [p for p in descendants(pid) if b"spawn_main" in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def complete(url: str, prompt: str, max_tokens: int = 48, **extra) -> httpx.Response:
    body = {"model": str(STORIES), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)


def check_reference(url: str, reference: list[dict]) -> None:
    for case in reference:
        answer = complete(url, case["prompt"]).json()
        assert case["prompt"] + answer["choices"][0]["text"] == case["full_text"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_tp_3_on_an_8_head_model_names_the_rule(stories_dir):
    result = run_llmctl("serve", str(stories_dir), "--tp", "3", "--port", "0")
    assert result.returncode == 1
    message = " ".join(result.stderr.split())
    assert "Error:" in message and "Traceback" not in message
    assert "tensor_parallel_size" in message and "8 attention heads" in message
    assert "(use 1, 2, 4)" in message  # 8 does not divide its MLP size, 172


def test_turbo_refuses_tp_and_auto_picks_torch(stories_dir):
    refused = run_llmctl("serve", str(stories_dir), "--backend", "turbo", "--tp", "2")
    assert refused.returncode == 1
    message = " ".join(refused.stderr.split())
    assert "tensor_parallel_size=2 (set by flag (--tensor-parallel-size)) is refused by turbo" in (
        message
    )
    assert "one device of one machine" in message
    shown = run_llmctl("config", "show", "--model", str(stories_dir), "--tp", "2")
    assert shown.returncode == 0, shown.stderr
    assert "auto chooses torch" in shown.stdout
    (row,) = [line for line in shown.stdout.splitlines() if "tensor_parallel_size" in line]
    assert row.split()[-2:] == ["2", "│"]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(reference):
    server = start_server(serve_args("--tp", "2"), env=ENV)
    try:
        assert len(rank_processes(server.process.pid)) == 1
        check_reference(server.url, reference[:1])
        everything = descendants(server.process.pid)
        # Ctrl-C in a terminal: SIGINT to every process of the foreground group.
        for pid in [server.process.pid, *everything]:
            os.kill(pid, signal.SIGINT)
        code = server.process.wait(30)
        assert code == 130, server.log()[-4000:]  # stopped by Ctrl-C, as without --tp
        assert wait_gone(everything) == []
    finally:
        server.stop()


def test_serve_tp2_gives_the_reference_until_a_killed_rank_stops_it(reference):
    server = start_server(serve_args("--tp", "2"), env=ENV)
    try:
        check_reference(server.url, reference)
        assert metric(server.url, "llmctl_tensor_parallel_size") == 2
        fail_rank_1(server, signal.SIGKILL, "was killed by SIGKILL")
    finally:
        server.stop()


@pytest.mark.slow
def test_a_hung_rank_stops_the_server_within_30s(reference):
    server = start_server(serve_args("--tp", "2"), env=ENV)
    try:
        fail_rank_1(server, signal.SIGSTOP, "stopped responding")
    finally:
        server.stop()


def fail_rank_1(server: ServerProcess, how: signal.Signals, cause: str) -> None:
    """Signal rank 1 while requests run: they fail with 503, the server exits non-zero
    naming the rank within the deadline, and no process is left."""
    (rank,) = rank_processes(server.process.pid)
    everything = descendants(server.process.pid)
    in_flight = start_long_requests(server.url)
    time.sleep(1.0)  # both are generating
    os.kill(rank, how)
    assert_dies_naming_rank_1(server, time.monotonic(), cause)
    assert_in_flight_requests_failed(in_flight)
    assert wait_gone(everything) == []


def start_long_requests(url: str) -> dict[str, object]:
    """A plain and a streamed request long enough to be in flight when a rank fails."""
    results: dict[str, object] = {}

    def plain() -> None:
        results["plain"] = complete(url, "Once upon a time", 480, ignore_eos=True)

    def streamed() -> None:
        body = {
            "model": str(STORIES),
            "prompt": "The cat",
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
            results["stream"] = [line for line in reply.iter_lines() if line]

    threads = [threading.Thread(target=fn) for fn in (plain, streamed)]
    for thread in threads:
        thread.start()
    results["threads"] = threads
    return results


def assert_dies_naming_rank_1(server: ServerProcess, since: float, cause: str) -> None:
    try:
        code = server.process.wait(FAILURE_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs {FAILURE_DEADLINE_S} s after:\n{server.log()}")
    assert time.monotonic() - since < FAILURE_DEADLINE_S
    assert code != 0
    log = " ".join(server.log().split())
    assert "Error: the inference engine failed and the server has stopped: rank 1" in log, log
    assert cause in log, log


def assert_in_flight_requests_failed(results: dict[str, object]) -> None:
    for thread in results["threads"]:
        thread.join(30)
    plain = results["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "engine_dead"
    assert "rank 1" in plain.json()["error"]["message"]
    assert any("engine_dead" in line for line in results["stream"])


def start_worker_node(port: int) -> subprocess.Popen:
    """The second "machine": ``llmctl serve --node-rank 1`` (it serves no HTTP)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    env.update(ENV, COLUMNS="200", NO_COLOR="1")
    args = serve_args("--tp", "2", "--nnodes", "2", "--node-rank", "1")
    args += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return subprocess.Popen(
        [sys.executable, "-m", "llmctl", "serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def start_head_node(port: int) -> ServerProcess:
    args = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    return start_server(serve_args(*args, "--master-port", str(port)), env=ENV)


def test_two_machines_give_the_reference_and_stop_together(reference):
    port = free_port()
    worker = start_worker_node(port)
    try:
        head = start_head_node(port)
        try:
            assert rank_processes(head.process.pid) == []  # rank 1 lives on the other node
            (rank,) = rank_processes(worker.pid)
            check_reference(head.url, reference[:1])
            assert metric(head.url, "llmctl_tensor_parallel_size") == 2
            assert head.stop() in (0, -signal.SIGTERM)  # the head stops every rank
        finally:
            head.stop()
        output, _ = worker.communicate(timeout=30)
        assert worker.returncode == 0, output
        assert "the head node stopped the engine" in output
        assert wait_gone([rank]) == []
    finally:
        worker.kill()


@pytest.mark.slow
def test_a_lost_machine_stops_the_head_naming_its_rank(reference):
    port = free_port()
    worker = start_worker_node(port)
    try:
        head = start_head_node(port)
        try:
            (rank,) = rank_processes(worker.pid)
            everything = descendants(head.process.pid)
            in_flight = start_long_requests(head.url)
            time.sleep(1.0)
            worker.kill()  # the whole machine's llmctl, without a chance to clean up
            lost_at = time.monotonic()
            assert_dies_naming_rank_1(head, lost_at, "rank 1")
            assert_in_flight_requests_failed(in_flight)
            assert wait_gone([rank, *everything]) == []
        finally:
            head.stop()
    finally:
        worker.kill()
