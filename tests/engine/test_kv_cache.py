"""KV-cache sizing from cache_max_entry_count in its three forms."""

from __future__ import annotations

import pytest

from llmctl.engine.kv_cache import plan_kv_cache
from llmctl.errors import OptionError
from llmctl.kv_budget import parse_kv_budget

MiB = 2**20


def plan(budget, free=1000 * MiB, per_block=MiB, block=64, seqs=8, length=1024):
    return plan_kv_cache(parse_kv_budget(budget), per_block, free, block, seqs, length)


def test_fraction_of_free_memory() -> None:
    result = plan(0.5, seqs=1000)
    assert result.num_blocks == 500 and result.note == ""
    assert result.describe() == "500 blocks x 64 tokens = 32000 tokens, 0.49 GiB"


def test_fraction_is_capped_at_what_max_num_seqs_full_sessions_need() -> None:
    result = plan("80%", seqs=4)  # 4 sessions x 16 blocks
    assert result.num_blocks == 64
    assert "capped from 0.8 of free memory" in result.describe()


def test_size_budget() -> None:
    assert plan("100MiB", seqs=1000).num_blocks == 100
    assert plan("100MiB", seqs=2).num_blocks == 32


def test_block_count_is_taken_as_given() -> None:
    assert plan(500, seqs=1).num_blocks == 500
    with pytest.raises(OptionError, match="only 1000.00 MiB is free: ask for at most 1000"):
        plan(2000)


def test_refused_when_one_full_session_does_not_fit() -> None:
    with pytest.raises(OptionError, match="session_len=1024 needs 16 blocks") as info:
        plan("10MiB")
    assert "10 blocks x 64 tokens = 640 tokens" in str(info.value)
    assert "raise cache_max_entry_count or lower session_len" in str(info.value)
