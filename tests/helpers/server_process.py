"""Start a real ``llmctl serve`` subprocess for a test, wait until it answers, stop it.

    with running_server(["demo", "--backend", "torch"]) as base_url:
        httpx.get(f"{base_url}/v1/models")

``start_server`` returns the ``ServerProcess`` itself for tests that need the process
(signals) or its log. The server's output goes to a file, printed when startup fails.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from llmctl.bench.server_process import free_port

# Each server's default working directory (and log) lives under this one, removed when
# the test session's interpreter exits, so runs leave no directories in /tmp.
_SESSION_DIR = tempfile.TemporaryDirectory(prefix="llmctl-tests-")


class ServerProcess:
    """A running ``python -m llmctl serve`` with its URL and log file."""

    def __init__(
        self,
        process: subprocess.Popen,
        url: str,
        log_path: Path,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path
        self.verify = verify  # how an https server's certificate is checked

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"llmctl serve exited with status {self.process.returncode} before it "
                    f"answered /health. Its log:\n{self.log()}"
                )
            try:
                health = httpx.get(f"{self.url}/health", timeout=2, verify=self.verify)
                if health.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llmctl serve did not answer /health in {timeout:.0f}s:\n{self.log()}")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    args: list[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
    cwd: Path | None = None,
    tls: ssl.SSLContext | None = None,
) -> ServerProcess:
    """Start ``llmctl serve ARGS --port P`` on a free port and wait for /health.

    The environment is the test's minus LLMCTL_* variables (the cache dir stays), plus
    ``env``. ``cwd`` defaults to a fresh temporary directory, so no ./llmctl.toml is read.
    ``tls``: the server serves HTTPS (ARGS give its certificate); this client context
    checks it.
    """
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    if "LLMCTL_CACHE_DIR" in os.environ:
        full_env["LLMCTL_CACHE_DIR"] = os.environ["LLMCTL_CACHE_DIR"]
    full_env.update({"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    full_env.update(env or {})
    workdir = (
        Path(cwd)
        if cwd is not None
        else Path(tempfile.mkdtemp(prefix="llmctl-serve-", dir=_SESSION_DIR.name))
    )
    log_path = workdir / f"llmctl-serve-{port}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "llmctl", "serve", *args, "--port", str(port)],
            cwd=workdir,
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    scheme = "https" if tls is not None else "http"
    server = ServerProcess(process, f"{scheme}://127.0.0.1:{port}", log_path, tls or True)
    try:
        server.wait_until_healthy(timeout)
    except BaseException:
        server.stop(timeout=5)
        raise
    return server


@contextmanager
def running_server(
    args: list[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 180,
    cwd: Path | None = None,
) -> Iterator[str]:
    """A server for the duration of the ``with`` block; yields its base URL (no /v1)."""
    server = start_server(args, env=env, timeout=timeout, cwd=cwd)
    try:
        yield server.url
    except BaseException:
        print(f"--- log of llmctl serve at {server.url} ---\n{server.log()}")
        raise
    finally:
        server.stop()
