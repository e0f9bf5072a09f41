"""Run the real ``llmctl`` command in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_llmctl(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    python: str = "",
    stdin: str | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    """``python -m llmctl ARGS`` with no LLMCTL_* from the test's shell (but the cache dir),
    a wide plain terminal, and ``env`` on top."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    if "LLMCTL_CACHE_DIR" in os.environ:
        full_env["LLMCTL_CACHE_DIR"] = os.environ["LLMCTL_CACHE_DIR"]
    full_env.update({"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    full_env.update(env or {})
    return subprocess.run(
        [python or sys.executable, "-m", "llmctl", *args],
        cwd=cwd,
        env=full_env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
