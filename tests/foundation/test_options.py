"""The option schema: names derived once, values converted and checked with clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmctl.errors import OptionError
from llmctl.kv_budget import KVBudget, parse_kv_budget
from llmctl.options import CORE_OPTIONS, option_named
from llmctl.options_doc import REFERENCE_PATH, render_options_reference
from tests.conftest import REPO

REQUIRED = {
    "model", "backend", "cache_block_seq_len", "cache_max_entry_count", "session_len",
    "max_batch_size", "max_prefill_token_num", "enable_prefix_caching", "dtype", "device",
    "lora", "max_loras", "max_lora_rank", "seed", "chat_template", "model_name", "host", "port", "api_keys",
    "max_concurrent_requests",
}  # fmt: skip


def test_schema_has_every_required_option_once():
    names = [opt.name for opt in CORE_OPTIONS]
    assert REQUIRED <= set(names)
    assert len(names) == len(set(names))


def test_flag_env_and_key_are_derived_from_the_name():
    opt = option_named("cache_block_seq_len")
    assert opt.flag == "--cache-block-seq-len"
    assert opt.env_var == "LLMCTL_CACHE_BLOCK_SEQ_LEN"
    assert opt.default == 64


def test_committed_reference_page_is_current():
    committed = (REPO / REFERENCE_PATH).read_text()
    assert committed == render_options_reference(), (
        "docs/reference/options.md is stale: run `python -m llmctl.options_doc`"
    )


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("cache_block_seq_len", "128", 128),
        ("enable_prefix_caching", "off", False),
        ("enable_prefix_caching", "TRUE", True),
        ("api_keys", "a, b,c", ["a", "b", "c"]),
        ("shutdown_timeout", "2.5", 2.5),
        ("dtype", "bfloat16", "bfloat16"),
    ],
)
def test_strings_from_env_convert(name, raw, expected):
    assert option_named(name).convert(raw, "test", text=True) == expected


@pytest.mark.parametrize(
    ("name", "raw", "fragment"),
    [
        ("cache_block_seq_len", "abc", "expected an integer"),
        ("cache_block_seq_len", 0, "too small"),
        ("cache_block_seq_len", 1.5, "expected an integer"),
        ("port", 70000, "too large"),
        ("dtype", "fp8", "not one of"),
        ("dtype", "bfloat", "Did you mean 'bfloat16'"),
        ("enable_prefix_caching", "maybe", "true or false"),
        ("cache_max_entry_count", "lots", "fraction of free memory"),
        ("cache_max_entry_count", "1.5", "(0, 1]"),
    ],
)
def test_bad_values_name_the_option_and_the_source(name, raw, fragment):
    with pytest.raises(OptionError) as exc:
        option_named(name).convert(raw, "flag --x")
    message = str(exc.value)
    assert name in message and fragment in message
    if "Did you mean" not in fragment and "not one of" not in fragment:
        assert "flag --x" in message


def test_unknown_option_suggests_the_closest():
    with pytest.raises(OptionError, match="Did you mean 'cache_block_seq_len'"):
        option_named("cache_block_seqlen")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (0.8, KVBudget("fraction", 0.8)),
        ("0.5", KVBudget("fraction", 0.5)),
        ("80%", KVBudget("fraction", 0.8)),
        ("1.0", KVBudget("fraction", 1.0)),
        ("4GiB", KVBudget("bytes", 4 * 2**30)),
        ("512 MiB", KVBudget("bytes", 512 * 2**20)),
        ("2GB", KVBudget("bytes", 2e9)),
        (2000, KVBudget("blocks", 2000)),
        ("1", KVBudget("blocks", 1)),
    ],
)
def test_kv_budget_has_three_unambiguous_forms(raw, expected):
    assert parse_kv_budget(raw) == expected


def test_kv_budget_buys_blocks():
    per_block = 1000
    assert parse_kv_budget("0.5").num_blocks(per_block, 10_000) == 5
    assert parse_kv_budget("3KB").num_blocks(per_block, 10_000) == 3
    assert parse_kv_budget(7).num_blocks(per_block, 10_000) == 7


@pytest.mark.parametrize("raw", ["0", "-3", "0.0", "150%", "0GiB", "4 parsecs", True])
def test_kv_budget_rejects_nonsense(raw):
    with pytest.raises(ValueError):
        parse_kv_budget(raw)


@pytest.mark.parametrize("flag", ["--help", "-h", "--check"])
def test_the_reference_writer_takes_no_flag_for_a_file_name(flag: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "llmctl.options_doc", flag],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
    )
    assert "usage: python -m llmctl.options_doc [PATH]" in run.stdout + run.stderr
    assert run.returncode == (0 if flag != "--check" else 1)
    assert list(tmp_path.iterdir()) == []  # nothing written, no file named after the flag
