"""Profiles and resolution: each level beats the one below, and errors name file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.errors import ProfileError
from llmctl.profiles import Source, get_profile, read_profile_file, resolve

PROFILE = """\
[profiles.small]
model = "demo"
cache_block_seq_len = 32
session_len = 1024

[profiles.small.turbo]
cache_block_seq_len = 128
"""


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "llmctl.toml"
    path.write_text(PROFILE)
    return path


def _block(flags=None, env=None, profile=None, backend=None, backend_defaults=None):
    return resolve(
        flags or {},
        profile=profile,
        backend=backend,
        backend_defaults=backend_defaults,
        env=env or {},
    )["cache_block_seq_len"]


def test_each_level_beats_the_one_below(profile_file):
    profile = get_profile("small", [profile_file])
    levels = [
        # (flags, env, profile, backend, backend default) -> expected value, source
        (({}, {}, None, "torch", {}), 64, Source.DEFAULT),
        (({}, {}, None, "torch", {"cache_block_seq_len": 16}), 16, Source.BACKEND_DEFAULT),
        (({}, {}, profile, "torch", {"cache_block_seq_len": 16}), 32, Source.PROFILE),
        (({}, {}, profile, "turbo", {"cache_block_seq_len": 16}), 128, Source.PROFILE_BACKEND),
        (
            ({}, {"LLMCTL_CACHE_BLOCK_SEQ_LEN": "256"}, profile, "turbo", {}),
            256,
            Source.ENV,
        ),
        (
            ({"cache_block_seq_len": 512}, {"LLMCTL_CACHE_BLOCK_SEQ_LEN": "256"}, profile, "turbo", {}),
            512,
            Source.FLAG,
        ),
    ]  # fmt: skip
    for (flags, env, prof, backend, defaults), value, source in levels:
        setting = _block(flags, env, prof, backend, defaults)
        assert (setting.value, setting.source) == (value, source)


def test_sources_carry_file_and_line(profile_file):
    profile = get_profile("small", [profile_file])
    assert f"{profile_file}:3" in _block(profile=profile, backend="torch").detail
    assert f"{profile_file}:7" in _block(profile=profile, backend="turbo").detail
    assert _block(env={"LLMCTL_CACHE_BLOCK_SEQ_LEN": "16"}).detail == "LLMCTL_CACHE_BLOCK_SEQ_LEN"


def test_explicit_is_set_by_the_user(profile_file):
    profile = get_profile("small", [profile_file])
    assert _block(profile=profile, backend="torch").explicit
    assert not _block(backend="torch", backend_defaults={"cache_block_seq_len": 16}).explicit


def test_bad_env_value_names_the_variable():
    with pytest.raises(Exception, match="LLMCTL_CACHE_BLOCK_SEQ_LEN"):
        _block(env={"LLMCTL_CACHE_BLOCK_SEQ_LEN": "big"})


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            '[profiles.a]\ncache_block_seqlen = 32\n',
            [":2", "unknown key 'cache_block_seqlen'", "Did you mean 'cache_block_seq_len'"],
        ),
        ('[profiles.a]\nport = "eighty"\n', [":2", "port", "expected an integer"]),
        ("[profiles.a]\nmax_batch_size = 0\n", [":2", "max_batch_size", "too small"]),
        ('[profiles.a]\nmodel = "demo"\n[profiles.a.turob]\nseed = 1\n', [":3", "Did you mean 'turbo'"]),
        ('[profiles.a]\nmodel = "demo\n', ["malformed TOML", "line 2"]),
        ('title = "x"\n', [":1", "unknown top-level key 'title'"]),
        ('[profiles.a]\ndtype = "fp8"\n', [":2", "dtype", "not one of"]),
    ],
)  # fmt: skip
def test_broken_profiles_name_file_line_and_key(tmp_path, text, fragments):
    path = tmp_path / "llmctl.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as exc:
        read_profile_file(path)
    message = str(exc.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_missing_profile_lists_known_ones(profile_file):
    with pytest.raises(ProfileError, match="'smal' not found. Did you mean 'small'"):
        get_profile("smal", [profile_file])


def test_first_file_wins(tmp_path, profile_file):
    other = tmp_path / "other.toml"
    other.write_text("[profiles.small]\nseed = 5\n[profiles.other]\nseed = 6\n")
    from llmctl.profiles import load_profiles

    profiles = load_profiles([profile_file, other])
    assert profiles["small"].file == profile_file
    assert profiles["other"].common == {"seed": 6}
