"""The Python API checks its keyword options exactly as a profile checks its keys."""

from __future__ import annotations

import pytest

from llmctl import LLM
from llmctl.errors import BackendError, OptionError, ProfileError
from llmctl.profiles import read_profile_file


def test_a_misspelled_option_is_the_error_a_profile_gives(tmp_path):
    with pytest.raises(OptionError) as from_api:
        LLM("demo", cache_block_seq_lne=32)
    profile = tmp_path / "llmctl.toml"
    profile.write_text("[profiles.p]\ncache_block_seq_lne = 32\n")
    with pytest.raises(ProfileError) as from_profile:
        read_profile_file(profile)
    for message in (str(from_api.value), str(from_profile.value)):
        assert "unknown key 'cache_block_seq_lne'" in message
        assert "Did you mean 'cache_block_seq_len'?" in message
        assert "See `llmctl config show` for every option." in message
    assert str(from_api.value).startswith("LLM(cache_block_seq_lne=...)")


def test_an_option_llmctl_does_not_have_is_refused():
    with pytest.raises(OptionError, match="unknown key 'gpu_memory_utilization'"):
        LLM("demo", gpu_memory_utilization=0.9)


def test_a_bad_value_names_the_option_and_where_it_was_given():
    with pytest.raises(OptionError, match=r"cache_block_seq_len \(from LLM\(cache_block_seq_len"):
        LLM("demo", cache_block_seq_len="big")


def test_a_value_the_backend_refuses_is_an_error_not_a_silent_change():
    with pytest.raises(BackendError, match="cache_block_seq_len=48.*power of two"):
        LLM("demo", backend="torch", cache_block_seq_len=48)
