"""Broken model directories, as a user meets them: every kind of damage in ``broken_dirs``
gives a non-zero exit, one ``Error:`` paragraph naming what is wrong and no traceback, on
``serve --backend torch``, ``serve --backend turbo`` and ``backends check`` (which also
lists it as each backend's reason). Nothing starts serving.

Every case runs in-process through what those commands call (``select`` for each
backend, ``assess`` for each backend's reasons): milliseconds each. The real CLI runs as
subprocesses on a fixed sample and a daily draw of the rest (the slow cases, about 4
CPU-seconds each; ``--all-slow`` runs the whole corpus).
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmctl.errors import ModelError
from llmctl.hardware import Hardware
from llmctl.model.info import resolve_model
from llmctl.selection import assess, installed_backends, select
from tests.conftest import STORIES
from tests.helpers.cli import run_llmctl
from tests.models.broken_dirs import CASES, UNRESOLVED

ALL_CASES = {**CASES, **UNRESOLVED}
COMMANDS = {
    "serve-torch": ("serve", "--backend", "torch", "--port", "0"),
    "serve-turbo": ("serve", "--backend", "turbo", "--port", "0"),
    "backends-check": ("backends", "check"),
}
# What the CLI adds (exit status, the Error paragraph, reasons printed per backend, no
# server) does not depend on the kind of damage: by default a damaged weights file, a
# config.json that disagrees with the weights (turbo used to serve it) and a broken
# tokenizer run through it.
CLI_SAMPLE = {"truncated-weights", "vocab-size-disagrees", "tokenizer-not-json"}
# turbo's check then answers at once (no native build) and the model's problems follow.
NO_COMPILER = Hardware(cxx_compiler=None, cpu_count=2, memory_bytes=2**34)


def broken_copy(root: Path, case: str) -> Path:
    """A writable copy of stories260K with ``case``'s damage; returns the model argument."""
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    model_dir = root / case
    shutil.copytree(STORIES, model_dir)
    for path in [model_dir, *model_dir.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    damage, _ = ALL_CASES[case]
    return damage(model_dir)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_every_backend_refuses_before_building_an_engine(tmp_path, case):
    model = broken_copy(tmp_path, case)
    _, fragments = ALL_CASES[case]
    for backend in ("torch", "turbo"):
        with pytest.raises(ModelError) as refused:
            select(str(model), {"backend": backend}, hardware=NO_COMPILER, env={})
        for fragment in fragments:
            assert fragment in flat(str(refused.value)), (backend, str(refused.value))


@pytest.mark.parametrize("case", list(CASES))
def test_each_backends_check_gives_the_problem_as_a_reason(tmp_path, case):
    model = resolve_model(str(broken_copy(tmp_path, case)))
    _, fragments = CASES[case]
    for name in ("torch", "turbo"):
        reasons = flat(
            " ".join(
                assess(installed_backends()[name], model, {}, None, NO_COMPILER, env={}).reasons
            )
        )
        for fragment in fragments:
            assert fragment in reasons, (name, reasons)


def test_several_problems_are_listed_in_one_paragraph(tmp_path):
    with pytest.raises(ModelError) as refused:
        select(str(broken_copy(tmp_path, "two-problems")), {"backend": "torch"}, env={})
    message = str(refused.value)
    assert "two-problems has 2 problems:\n  - " in message and message.count("\n  - ") == 2


def test_the_undamaged_fixture_has_no_problem(tmp_path):
    model = resolve_model(str(STORIES)) if STORIES.is_dir() else pytest.skip("no stories260K")
    assert model.problems == []
    assert model.report.config is not None and model.report.tokenizer is not None
    assert len(model.report.tensors) == 47


def run_commands(model: Path) -> dict[str, object]:
    """The three commands on one broken model, side by side (they are independent)."""
    with ThreadPoolExecutor(max_workers=len(COMMANDS)) as pool:
        done = pool.map(lambda args: run_llmctl(*args, str(model), timeout=120), COMMANDS.values())
        return dict(zip(COMMANDS, done))


@pytest.mark.parametrize(
    "case",
    [
        case if case in CLI_SAMPLE else pytest.param(case, marks=pytest.mark.slow)
        for case in ALL_CASES
    ],
)
def test_the_cli_says_one_clear_error_and_serves_nothing(tmp_path, case):
    _, fragments = ALL_CASES[case]
    results = run_commands(broken_copy(tmp_path, case))
    for command, result in results.items():
        output = result.stdout + result.stderr
        where = f"{case}, {command}:\n{output}"
        assert result.returncode == 1, where
        assert "Traceback" not in output, where
        assert output.count("Error:") == 1, where
        error = flat(result.stderr[result.stderr.index("Error:") :])  # the last thing said
        for fragment in fragments:
            assert fragment in error, where
        assert "Serving on" not in output and "KV cache" not in output, where
    if case in CASES:  # a directory to check: each backend gives the problem as its reason
        reasons = flat(results["backends-check"].stdout)
        assert "✗ turbo cannot serve" in reasons and "✗ torch cannot serve" in reasons
        for fragment in fragments:
            assert reasons.count(fragment) >= 2, results["backends-check"].stdout


def test_a_chat_template_option_replaces_a_broken_template_of_the_model(tmp_path):
    model_dir = broken_copy(tmp_path, "chat-template-does-not-compile")
    with pytest.raises(ModelError, match="does not compile"):
        select(str(model_dir), {"backend": "torch"}, hardware=NO_COMPILER, env={})
    override = "{% for m in messages %}{{ m.content }}{% endfor %}"
    choice = select(
        str(model_dir),
        {"backend": "torch", "chat_template": override},
        hardware=NO_COMPILER,
        env={},
    )
    assert choice.model.problems == []
    # ...and the override itself is checked: a broken one is named, not the model's.
    with pytest.raises(ModelError, match="does not compile") as refused:
        select(str(model_dir), {"chat_template": "{% if x %}"}, hardware=NO_COMPILER, env={})
    assert "tokenizer_config.json" not in str(refused.value)
