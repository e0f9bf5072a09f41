"""Run ``llmctl`` in-process (torch is imported once for all bench tests)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from typer.testing import CliRunner, Result

from llmctl.cli.main import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def invoke(command: str) -> Result:
    """``llmctl COMMAND`` (split like a shell would); fails the test if it exits non-zero."""
    result = CliRunner().invoke(app, shlex.split(command), env=ENV)
    if result.exit_code != 0:
        raise AssertionError(
            f"llmctl {command} exited {result.exit_code}:\n{result.output}"
        ) from result.exception
    return result


def invoke_failing(command: str) -> Result:
    """``llmctl COMMAND``, which must fail."""
    result = CliRunner().invoke(app, shlex.split(command), env=ENV)
    assert result.exit_code != 0, f"llmctl {command} succeeded:\n{result.output}"
    return result


def q(path: Path | str) -> str:
    """A path quoted for a command string."""
    return shlex.quote(str(path))


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
