"""Help and tables read at 80 columns: `--help` lists the common options in panels (with
their defaults), `--help-all` every one, and no flag or table cell is cut short."""

from __future__ import annotations

import re

import pytest

from llmctl.cli.schema_flags import COMMON
from llmctl.options import options_for
from tests.helpers.cli import run_llmctl

COMMANDS = [["serve"], ["chat"], ["backends", "check"], ["config", "show"]]


def llmctl(*args: str, cwd=None, columns: int = 80) -> str:
    result = run_llmctl(*args, env={"COLUMNS": str(columns)}, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout


def flags(text: str) -> set[str]:
    """The flags listed in the option panels (not those the description mentions)."""
    return set(re.findall(r"^│ (--[a-z][a-z0-9-]*)", text, flags=re.M))


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_is_short_and_help_all_shows_every_option_uncut(command):
    short, full = llmctl(*command, "--help"), llmctl(*command, "--help-all")
    assert "…" not in short and "…" not in full  # at 80 columns nothing is cut short
    assert len(full.splitlines()) > 2 * len(short.splitlines())
    assert "Common options" in short and "--help-all" in short
    # Which flags each lists (read wide, where every name fits on its line).
    short_flags = flags(llmctl(*command, "--help", columns=250))
    full_flags = flags(llmctl(*command, "--help-all", columns=250))
    for opt in options_for(" ".join(command)):
        if opt.name == "model":
            continue  # the MODEL argument
        assert opt.flag in full_flags, opt.flag
        assert (opt.flag in short_flags) == (opt.name in COMMON), opt.flag


def test_serve_help_shows_defaults_and_the_tp_alias():
    assert "--tp" in llmctl("serve", "--help")
    wide = llmctl("serve", "--help", columns=250)
    assert "[default: 64]" in wide and "[default: 8000]" in wide


def test_an_option_left_out_of_help_still_works():
    shown = llmctl("config", "show", "--max-batch-size", "7")
    assert re.search(r"max_batch_size\s*│\s*7\s", shown)


def test_tables_fold_long_names_instead_of_cutting_them(tmp_path):
    name = "a-profile-with-a-very-long-name-that-no-narrow-terminal-can-hold-on-one-line"
    (tmp_path / "llmctl.toml").write_text(
        f"[profiles.{name}]\nseed = 1\n[profiles.{name}.torch]\ncache_block_seq_len = 32\n"
    )
    for args in (
        ["plugins"],
        ["backends"],
        ["profiles", "list"],
        ["profiles", "show", name],
        ["config", "show", "--explain", "--profile", name, "--backend", "torch"],
    ):
        out = llmctl(*args, cwd=tmp_path)
        assert "…" not in out, (args, out)
    plugins = llmctl("plugins")
    cells = "".join(re.findall(r"│ ([^│]*?)\s*│\s*$", plugins, flags=re.M))
    assert "llmctl_register_backends" in cells.replace(" ", "")
