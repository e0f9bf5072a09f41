"""The seeded workload: lengths, reproducibility and which token ids prompts may use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmctl.bench.workload import (
    LengthRange,
    make_workload,
    ordinary_token_ids,
    parse_length_range,
)
from llmctl.errors import ModelError, OptionError


def test_parse_length_range_fixed_and_uniform() -> None:
    assert parse_length_range("128", "--input-len") == LengthRange(128, 128)
    assert parse_length_range("16:256", "--input-len") == LengthRange(16, 256)


@pytest.mark.parametrize("text", ["", "abc", "0", "9:3", "1:2:3", "-4", "4:"])
def test_parse_length_range_refuses_bad_text_naming_the_flag(text: str) -> None:
    with pytest.raises(OptionError, match="--output-len"):
        parse_length_range(text, "--output-len")


def test_workload_is_seeded_and_within_bounds() -> None:
    ids = list(range(3, 512))
    first = make_workload(ids, 200, LengthRange(16, 256), LengthRange(5, 9), seed=7)
    again = make_workload(ids, 200, LengthRange(16, 256), LengthRange(5, 9), seed=7)
    other = make_workload(ids, 200, LengthRange(16, 256), LengthRange(5, 9), seed=8)
    assert first.requests == again.requests
    assert first.requests != other.requests
    input_lens = [len(r.prompt_token_ids) for r in first.requests]
    output_lens = [r.output_len for r in first.requests]
    assert min(input_lens) >= 16 and max(input_lens) <= 256
    assert set(output_lens) == {5, 6, 7, 8, 9}  # uniform over 5..9: 200 draws hit each
    assert len(set(input_lens)) > 50  # really spread, not one length
    assert all(set(r.prompt_token_ids) <= set(ids) for r in first.requests)
    assert first.prompt_tokens == sum(input_lens)
    assert first.output_tokens == sum(output_lens)
    assert first.describe()["num_prompts"] == 200


def test_fixed_lengths() -> None:
    workload = make_workload([5, 6], 4, LengthRange(3, 3), LengthRange(2, 2), seed=0)
    assert [len(r.prompt_token_ids) for r in workload.requests] == [3, 3, 3, 3]
    assert workload.longest_request == 5


def test_num_prompts_must_be_positive() -> None:
    with pytest.raises(OptionError, match="--num-prompts"):
        make_workload([5], 0, LengthRange(1, 1), LengthRange(1, 1), seed=0)


def test_ordinary_ids_exclude_the_tokenizers_special_tokens(stories_dir: Path) -> None:
    config = json.loads((stories_dir / "config.json").read_text())
    ids = ordinary_token_ids(stories_dir, config)
    special = [
        t["id"]
        for t in json.loads((stories_dir / "tokenizer.json").read_text())["added_tokens"]
        if t["special"]
    ]
    assert special and not set(special) & set(ids)
    assert ids == [i for i in range(config["vocab_size"]) if i not in special]


def test_ordinary_ids_without_tokenizer_use_the_config(tmp_path: Path) -> None:
    config = {"vocab_size": 10, "bos_token_id": 1, "eos_token_id": [2, 9], "pad_token_id": None}
    assert ordinary_token_ids(tmp_path, config) == [0, 3, 4, 5, 6, 7, 8]


def test_ordinary_ids_stop_at_the_smaller_vocabulary(tmp_path: Path) -> None:
    # Embedding rows padded beyond the tokenizer (common): ids past the tokenizer are unused.
    tokenizer = {"model": {"vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": []}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert ordinary_token_ids(tmp_path, {"vocab_size": 64}) == [0, 1, 2]


def test_missing_vocab_size_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="vocab_size"):
        ordinary_token_ids(tmp_path, {})
