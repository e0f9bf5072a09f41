"""Importing llmctl makes torch's OpenMP threads sleep while they wait (see
llmctl/__init__.py), unless the user chose otherwise or torch was imported first."""

from __future__ import annotations

import os
import subprocess
import sys

SHOW = "import os, sys; {first}; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy(first: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    result = subprocess.run(
        [sys.executable, "-c", SHOW.format(first=first)],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    )
    return result.stdout.strip()


def test_importing_llmctl_sets_passive_waits() -> None:
    assert _policy("import llmctl") == "PASSIVE"


def test_a_policy_the_user_set_is_kept() -> None:
    assert _policy("import llmctl", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_nothing_is_set_once_torch_is_loaded() -> None:
    # libgomp read the environment when torch loaded: a value set now would only mislead.
    assert _policy("import torch; import llmctl") == "None"
