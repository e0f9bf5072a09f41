"""Run the real ``llmctl`` command in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_llmctl(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    if "LLMCTL_CACHE_DIR" in os.environ:
        full_env["LLMCTL_CACHE_DIR"] = os.environ["LLMCTL_CACHE_DIR"]
    full_env.update({"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "llmctl", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
