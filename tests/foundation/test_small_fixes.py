"""Small things a new user ran into (issue 33, item 11), each checked the way they met it."""

from __future__ import annotations

import logging

import pytest

from llmctl.errors import BackendError, ModelError
from llmctl.model.info import DEFAULT_MODEL, resolve_model
from llmctl.selection import select
from tests.helpers.cli import run_llmctl


def test_the_hub_hint_names_the_current_command():
    with pytest.raises(ModelError) as exc:
        resolve_model("some-org/not-in-the-cache")
    assert "`hf download some-org/not-in-the-cache`" in str(exc.value)
    assert "huggingface-cli" not in str(exc.value)


def test_log_lines_to_a_file_are_not_wrapped():
    long_name = "LLMCTL_" + "X" * 150
    result = run_llmctl("config", "show", env={long_name: "1", "COLUMNS": "80"})
    lines = [line for line in result.stderr.splitlines() if long_name in line]
    assert (
        len(lines) == 1 and lines[0].startswith("WARNING") and "is not an llmctl option" in lines[0]
    )


def test_version_help_shows_no_placeholder():
    result = run_llmctl("--help")
    line = next(line for line in result.stdout.splitlines() if "--version" in line)
    assert "<bool>" not in line and "Print the version" in line


def test_more_cpu_threads_than_cores_is_a_warning(caplog):
    import os

    cores = len(os.sched_getaffinity(0))
    with caplog.at_level(logging.WARNING, logger="llmctl"):
        select("demo", {"cpu_threads": cores + 2, "backend": "torch"}, env={})
    assert any(
        f"cpu_threads={cores + 2} is more than the {cores} CPU core(s) here" in r.getMessage()
        for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmctl"):
        select("demo", {"cpu_threads": 1, "backend": "torch"}, env={})
    assert not [r for r in caplog.records if "cpu_threads" in r.getMessage()]


def test_a_model_nobody_named_is_called_the_default():
    with pytest.raises(BackendError) as exc:
        select(None, {"backend": "openai-proxy"}, env={})
    expected = f"no backend can serve the default model {DEFAULT_MODEL} (no model was given) here"
    assert expected in str(exc.value)
    with pytest.raises(BackendError) as named:
        select("demo", {"backend": "openai-proxy"}, env={})
    assert "no backend can serve demo here" in str(named.value)
