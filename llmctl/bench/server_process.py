"""Start ``llmctl serve`` in a subprocess for a sweep's serve runs, and stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from llmctl.errors import LlmctlError
from llmctl.options import option_named


def flags_to_args(flags: Mapping[str, Any]) -> list[str]:
    """Command-line flags that give ``flags`` (option name -> value) back to a command."""
    args: list[str] = []
    for name, value in flags.items():
        opt = option_named(name)
        if opt.kind == "bool":
            args.append(opt.flag if value else f"--no-{opt.flag[2:]}")
        elif opt.kind == "list":
            for item in value:
                args += [opt.flag, str(item)]
        elif opt.kind == "map":
            for name, item in value.items():
                args += [opt.flag, f"{name}={item}"]
        else:
            args += [opt.flag, str(value)]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llmctl_server(
    model: str,
    flags: Mapping[str, Any],
    *,
    profile: str | None = None,
    startup_timeout_s: float = 300.0,
) -> Iterator[str]:
    """Run ``llmctl serve MODEL`` with ``flags`` on a free local port; yield its URL."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "llmctl", "serve", model, "--host", "127.0.0.1"]
    command += ["--port", str(port), *flags_to_args(flags)]
    if profile is not None:
        command += ["--profile", profile]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if process.poll() is not None:
                    raise LlmctlError(
                        f"`{' '.join(command)}` exited with code {process.returncode} before "
                        f"serving:\n{_tail(log)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise LlmctlError(
                        f"`{' '.join(command)}` did not answer {url}/health within "
                        f"{startup_timeout_s:.0f} s:\n{_tail(log)}"
                    )
                time.sleep(0.25)
            yield url
        finally:
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM first (the server drains and exits), then kill if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(log: Any, chars: int = 2000) -> str:
    log.flush()
    size = os.fstat(log.fileno()).st_size
    log.seek(max(0, size - chars))
    return log.read().decode(errors="replace")
