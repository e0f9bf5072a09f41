"""Resident memory of ``llmctl serve`` before its first request, per CPU backend.

    python scripts/bench_serve_memory.py                    # the 24M random Llama
    python scripts/bench_serve_memory.py --model DIR --backends turbo,torch

For each backend: start ``llmctl serve MODEL --backend NAME`` with default options on a
free local port, wait until ``/health`` answers, read the server process's resident set
(VmRSS) and its high-water mark (VmHWM) from /proc, stop it. The goal: under 1.5 GiB
before the first request. The 24M model (``make_random_llama.py``) is made in
``--work-dir`` if absent. Prints one table.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from make_random_llama import default_random_llama

GOAL_BYTES = 1.5 * 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the 24M Llama")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/llmctl-bench"))
    parser.add_argument("--backends", default="turbo,torch", help="comma-separated")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to start")
    return parser.parse_args()


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def serve_memory(model: Path, backend: str, timeout: float) -> dict[str, int]:
    import httpx

    from llmctl.bench.server_process import free_port

    port = free_port()
    command = [sys.executable, "-m", "llmctl", "serve", str(model), "--backend", backend,
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"llmctl serve --backend {backend} exited:\n"
                                 f"{server.stderr.read().decode()}")  # fmt: skip
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return memory_of(server.pid)
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"llmctl serve --backend {backend} did not start in {timeout:.0f} s")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    args = parse_args()
    model = args.model or default_random_llama(args.work_dir / "llama-24m")
    rows = [(b, serve_memory(model, b, args.timeout)) for b in args.backends.split(",")]
    print(f"\n`llmctl serve {model.name}` with default options, before the first request\n")
    print("| backend | resident (MiB) | peak resident so far (MiB) | goal |")
    print("|---|---|---|---|")
    for backend, memory in rows:
        verdict = "met" if memory["VmRSS"] < GOAL_BYTES else "not met"
        print(
            f"| {backend} | {memory['VmRSS'] / 2**20:,.0f} | {memory['VmHWM'] / 2**20:,.0f} "
            f"| < 1,536 ({verdict}) |"
        )


if __name__ == "__main__":
    main()
