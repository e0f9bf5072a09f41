"""The transformers plugin against the oldest transformers it declares, beside the
newest that the rest of the suite runs: ``scripts/setup.sh`` installs that release into
``.venv/oldest-transformers``, and the plugin's engine tests run again with it first on
``PYTHONPATH`` (greedy tokens against transformers' own generate, streaming, aborts, the
plain-generate fallback)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
from llmctl_transformers.plugin import MIN_TRANSFORMERS
from packaging.requirements import Requirement
from packaging.version import Version

OLDEST = Path(sys.prefix) / "oldest-transformers"
REPO = Path(__file__).resolve().parents[2]


def declared_floor() -> str:
    for requirement in map(Requirement, requires("llmctl-transformers")):
        if requirement.name == "transformers":
            return next(s.version for s in requirement.specifier if s.operator == ">=")
    raise AssertionError("llmctl-transformers declares no transformers requirement")


def oldest_env() -> dict[str, str]:
    if not OLDEST.is_dir():
        pytest.skip(f"{OLDEST} is missing: scripts/setup.sh installs it")
    path = os.pathsep.join(filter(None, [str(OLDEST), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def test_the_declared_floor_is_the_plugins_and_the_one_installed():
    floor = declared_floor()
    assert Version(floor).release[:2] == MIN_TRANSFORMERS
    found = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=oldest_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert Version(found.stdout.strip()) == Version(floor)


@pytest.mark.slow  # the plugin's engine tests once more, on the oldest release
def test_the_engine_tests_pass_on_the_oldest_transformers():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/plugins/test_transformers_engine.py",
        ],
        cwd=REPO,
        env=oldest_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]
