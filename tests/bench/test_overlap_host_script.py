"""``scripts/bench_overlap_host.py`` runs the plain and the overlapped step loop over one
runner and prints their host work: a small run must finish, both loops giving the same
tokens (the script checks), with a row for each and their ratio."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_the_script_compares_both_loops_on_the_same_tokens(stories_dir) -> None:
    command = [sys.executable, str(REPO / "scripts" / "bench_overlap_host.py"), str(stories_dir)]
    options = ["--num-prompts", "6", "--output-len", "40", "--rounds", "1", "--backend", "torch"]
    done = subprocess.run(command + options, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| plain", "| overlapped"]
    assert "overlapped / plain host work:" in done.stdout
