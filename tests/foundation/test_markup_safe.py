"""Nothing a user or a file wrote is read as rich markup: random bracketed strings go
through every error path, table and chat note and come out whole, and ``[/]`` (rich's
closing tag) crashes nothing."""

from __future__ import annotations

import io
import logging
import random
import string

import pytest
from rich.console import Console

from llmctl.chat.session import ChatSession
from tests.helpers.cli import run_llmctl


def bracketed(rng: random.Random) -> str:
    """A name holding markup-looking brackets: a tag, a closing tag, rich's ``[/]``..."""
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 6)))
    shapes = [f"[{word}]", "[/]", f"[/{word}]", f"[bold {word}]", f"[{word}=1]", f"[[{word}]]"]
    picked = rng.sample(shapes, 2)
    return f"{word}{picked[0]}x{picked[1]}"


SEEDS = [random.randrange(1 << 30) for _ in range(3)]  # fresh strings each run


@pytest.fixture(params=SEEDS, ids=[f"seed{seed}" for seed in SEEDS])
def name(request) -> str:
    return bracketed(random.Random(request.param))


def llmctl(*args: str, cwd) -> str:
    result = run_llmctl(*args, cwd=cwd, env={"COLUMNS": "500"}, stdin="hello")
    assert "MarkupError" not in result.stderr and "Traceback" not in result.stderr
    return result.stdout + result.stderr


def toml_key(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def test_profile_errors_keep_table_names_and_sources(tmp_path, name):
    profile = tmp_path / "llmctl.toml"
    cases = {
        f"[profiles.{toml_key(name)}]\ncache_blok_seq_len = 32\n": [
            f"in [profiles.{name}]",
            "llmctl.toml:2:",
        ],
        f"[profiles.p]\n[profiles.p.{toml_key(name)}]\nseed = 1\n": [
            f"llmctl.toml:2: [profiles.p.{name}] names no installed backend"
        ],
        f"{toml_key(name)} = 1\n": [
            f"llmctl.toml:1: unknown top-level key {name!r}: profiles go in [profiles.NAME] tables"
        ],
        f"[profiles.{toml_key(name)}]\ncache_block_seq_len = 0\n": [
            f"llmctl.toml:2 [profiles.{name}]) is too small"
        ],
    }
    for text, expected in cases.items():
        profile.write_text(text)
        out = llmctl("profiles", "validate", str(profile), cwd=tmp_path)
        for piece in expected:
            assert piece in out, (text, out)


def test_tables_and_explain_show_names_whole(tmp_path, name):
    (tmp_path / "llmctl.toml").write_text(
        f"[profiles.{toml_key(name)}]\nmodel = {toml_key(name + '/m')}\nseed = 7\n"
        f"[profiles.{toml_key(name)}.torch]\ncache_block_seq_len = 32\n"
    )
    listed = llmctl("profiles", "list", cwd=tmp_path)
    assert name in listed and f"{name}/m" in listed
    shown = llmctl("profiles", "show", name, cwd=tmp_path)
    assert f"profiles.{name}.torch" in shown
    explained = llmctl(
        "config", "show", "--explain", "--profile", name, "--backend", "torch", cwd=tmp_path
    )
    assert f"llmctl.toml:3 [profiles.{name}])" in explained
    assert f"llmctl.toml:5 [profiles.{name}.torch])" in explained


def test_a_model_path_is_reported_as_given(tmp_path, name):
    model = f"models{name}/x"
    for command in (
        ["serve"],
        ["chat"],
        ["models"],
        ["backends", "check"],
        ["config", "show", "--model"],
    ):
        out = llmctl(*command, model, cwd=tmp_path)
        assert f"'{model}'" in out, (command, out)


def test_chat_notes_print_text_literally(name):
    notes = io.StringIO()
    console = Console(file=notes, width=500, no_color=True)  # markup on: the worst case

    class NoConnection:
        has_chat_template = True
        model_name = name

    session = ChatSession(NoConnection(), None, notes=console)
    session.error(f"the server said {name}")
    session._system(name)
    session._system("")
    assert notes.getvalue().splitlines() == [
        f"error: the server said {name}",
        "System prompt set.",
        f"System prompt: {name}",
    ]


def test_log_lines_keep_brackets(capsys, monkeypatch, name):
    from llmctl.cli.main import setup_logging

    logger = logging.getLogger("llmctl")
    monkeypatch.setattr(logger, "handlers", [])  # a fresh setup, writing to this test's stderr
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    setup_logging(logging.INFO)
    logging.getLogger("llmctl").warning("backend %s skipped: %s", name, name)
    assert f"backend {name} skipped: {name}" in capsys.readouterr().err
