"""A value of the wrong type is refused, wherever it is typed (a profile, a keyword of
``LLM(...)``); only text sources (environment variables) are parsed. Unknown ``LLMCTL_*``
variables get a warning with the closest name; keywords are reported as keywords."""

from __future__ import annotations

import pytest

from llmctl import LLM
from llmctl.errors import BackendError, OptionError, ProfileError
from llmctl.options import option_named, unknown_env_vars
from llmctl.profiles import read_profile_file, resolve
from tests.helpers.cli import run_llmctl

WRONG_TYPES = [
    ("cache_block_seq_len", '"64"', "64", "expected an integer, got a string '64'"),
    ("cache_block_seq_len", "64.0", 64.0, "expected an integer, got a number 64.0"),
    ("cache_block_seq_len", "true", True, "expected an integer, got a boolean True"),
    ("enable_prefix_caching", '"yes"', "yes", "expected true or false (a boolean), got a string"),
    ("cuda_graphs", "1", 1, "expected true or false (a boolean), got an integer 1"),
    ("shutdown_timeout", '"2.5"', "2.5", "expected a number, got a string '2.5'"),
    ("api_keys", '"a,b"', "a,b", "expected a list of strings, got a string 'a,b'"),
    ("lora", '"a=/x"', "a=/x", "expected a table of names to strings"),
    ("dtype", "16", 16, "expected a string, got an integer 16"),
]


@pytest.mark.parametrize(("name", "toml", "python", "message"), WRONG_TYPES)
def test_a_profile_value_of_the_wrong_type_is_an_error(tmp_path, name, toml, python, message):
    profile = tmp_path / "llmctl.toml"
    profile.write_text(f"[profiles.p]\nseed = 1\n{name} = {toml}\n")
    with pytest.raises(ProfileError) as exc:
        read_profile_file(profile)
    assert f"{name} (from {profile}:3 [profiles.p]): {message}" in str(exc.value)


@pytest.mark.parametrize(("name", "toml", "python", "message"), WRONG_TYPES)
def test_a_keyword_of_the_wrong_type_is_an_error(name, toml, python, message):
    with pytest.raises(OptionError) as exc:
        LLM("demo", **{name: python})
    assert f"{name} (from LLM({name}=...)): {message}" in str(exc.value)


def test_the_right_types_pass_and_text_from_the_environment_is_parsed(tmp_path):
    profile = tmp_path / "llmctl.toml"
    profile.write_text(
        "[profiles.p]\ncache_block_seq_len = 32\nenable_prefix_caching = false\n"
        'shutdown_timeout = 2\napi_keys = ["a"]\ncache_max_entry_count = "2GiB"\n'
        '[profiles.p.lora]\nfirst = "/a"\nsecond = "/b"\n'
    )
    common = read_profile_file(profile)["p"].common
    assert common["shutdown_timeout"] == 2.0 and common["api_keys"] == ["a"]
    assert common["lora"] == {"first": "/a", "second": "/b"}  # a table, not a backend section
    env = {"LLMCTL_CACHE_BLOCK_SEQ_LEN": "128", "LLMCTL_ENABLE_PREFIX_CACHING": "no"}
    settings = resolve(
        {},
        env=env,
        options=[option_named(n) for n in ("cache_block_seq_len", "enable_prefix_caching")],
    )
    assert settings["cache_block_seq_len"].value == 128
    assert settings["enable_prefix_caching"].value is False


def test_an_unknown_llmctl_variable_is_named_with_the_closest_one():
    env = {
        "LLMCTL_CACHE_BLOK_SEQ_LEN": "32",
        "LLMCTL_SEDD": "1",
        "LLMCTL_SEED": "1",  # an option
        "LLMCTL_PROFILE": "p",  # not an option, but llmctl's
        "LLMCTL_TEST_FAULT": "x",  # tests' fault injection
        "OTHER_CACHE_BLOK": "1",  # not ours
    }
    warnings = unknown_env_vars(env)
    assert len(warnings) == 2
    assert "LLMCTL_CACHE_BLOK_SEQ_LEN is not an llmctl option" in warnings[0]
    assert "Did you mean 'LLMCTL_CACHE_BLOCK_SEQ_LEN'?" in warnings[0]
    assert "Did you mean 'LLMCTL_SEED'?" in warnings[1]


def test_the_cli_and_the_api_warn_about_an_unknown_variable(monkeypatch):
    result = run_llmctl("config", "show", env={"LLMCTL_CACHE_BLOK_SEQ_LEN": "32"})
    assert result.returncode == 0
    assert "LLMCTL_CACHE_BLOK_SEQ_LEN is not an llmctl option" in result.stderr
    assert "Did you mean 'LLMCTL_CACHE_BLOCK_SEQ_LEN'?" in result.stderr
    monkeypatch.setenv("LLMCTL_MAX_BATCH_SIZ", "4")
    with pytest.warns(UserWarning, match="Did you mean 'LLMCTL_MAX_BATCH_SIZE'"):
        LLM("demo", backend="torch", device="cpu").shutdown()


def test_a_keyword_is_reported_as_a_keyword_not_a_flag():
    with pytest.raises(BackendError) as exc:
        LLM("demo", backend="torch", cache_block_seq_len=48)
    message = str(exc.value)
    assert "(set by keyword argument (LLM(cache_block_seq_len=...)))" in message
    assert "flag" not in message
