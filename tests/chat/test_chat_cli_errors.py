"""``llmctl chat`` refuses bad arguments with one clear paragraph, before loading anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chat.run_chat import chat_piped, one_line
from tests.helpers.server_process import free_port


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--url", "http://127.0.0.1:1", "--session-len", "256"],
            "--session-len configure a local engine, but --url talks to a server",
        ),
        (["demo", "--url", "http://127.0.0.1:1"], "MODEL (demo) configure a local engine"),
        (["demo", "--model", "other"], "--model and --api-key are for a server given with --url"),
        (["--url", "127.0.0.1:8000"], "must start with http:// or https://"),
        (["demo", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["demo", "--max-tokens", "0"], "max_tokens must be at least 1, got 0"),
    ],
)
def test_bad_arguments(args: list[str], message: str, tmp_path: Path) -> None:
    result = chat_piped(args, "Once upon a time", tmp_path)
    assert result.returncode == 1
    assert message in one_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_empty_input_is_refused_before_loading(tmp_path: Path) -> None:
    result = chat_piped(["demo"], "\n", tmp_path)
    assert result.returncode == 1
    assert "nothing to answer: standard input was empty" in one_line(result.stderr)
    assert "chosen" not in result.stderr  # no backend chosen, no model loaded


def test_unreachable_server(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = chat_piped(["--url", url], "Once upon a time", tmp_path)
    assert result.returncode == 1
    assert f"cannot reach {url}" in result.stderr
    assert "Is the server running" in one_line(result.stderr)
