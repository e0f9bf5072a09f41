"""``EngineConfig``: built once from resolved options, one name per concept inside."""

from __future__ import annotations

import dataclasses

import pytest
from llmctl_torch.plugin import TorchBackend
from llmctl_turbo.plugin import TurboBackend

from llmctl.engine.config import EngineConfig
from llmctl.errors import OptionError
from llmctl.profiles import resolve


def resolved(**flags) -> dict:
    return {name: s.value for name, s in resolve(flags, env={}).items()}


def test_the_users_names_map_once_to_the_engines():
    options = resolved(cache_block_seq_len=32, max_batch_size=7, session_len=300, seed=5)
    config = EngineConfig.from_options(options)
    assert (config.block_size, config.max_num_seqs, config.max_model_len, config.seed) == (
        32,
        7,
        300,
        5,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 64  # type: ignore[misc]


def test_both_backends_translate_to_the_shared_config():
    options = resolved(cache_block_seq_len=32, kv_cache_dtype="int8", tensor_parallel_size=2)
    torch_config, turbo_config = (
        TorchBackend().translate(options),
        TurboBackend().translate(options),
    )
    for config in (torch_config, turbo_config):
        assert isinstance(config, EngineConfig)
        assert (config.block_size, config.kv_cache_dtype) == (32, "int8")
    assert torch_config.extra.tensor_parallel_size == 2  # the torch backend's own part
    assert turbo_config.extra is None


def test_a_value_the_engine_cannot_use_names_the_users_option():
    with pytest.raises(OptionError, match="cache_block_seq_len must be a positive integer"):
        EngineConfig(block_size=0)
    with pytest.raises(OptionError, match="max_batch_size"):
        EngineConfig(block_size=16, max_num_seqs=0)


def test_runners_capture_verification_graphs_only_when_speculating():
    """Both local runners get k = num_speculative_tokens (their verification graphs
    take k + 1 tokens per sequence), and 0 without speculation."""
    from llmctl.engine.config import SpeculativeConfig

    plain = EngineConfig(block_size=16)
    speculating = dataclasses.replace(plain, speculation=SpeculativeConfig("ngram", num_tokens=5))
    assert plain.runner_options("float32", "cpu", 64)["num_speculative_tokens"] == 0
    assert speculating.runner_options("float32", "cpu", 64)["num_speculative_tokens"] == 5
