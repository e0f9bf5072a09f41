"""ModelConfig: what is read from config.json, and the clear errors for what is not supported."""

from __future__ import annotations

import json

import pytest

from llmctl.errors import ModelError, OptionError
from llmctl.model.config import ModelConfig, RopeScaling, canonical_dtype

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def test_stories260k(stories_dir):
    config = ModelConfig.from_dir(stories_dir)
    assert (config.architecture, config.num_layers, config.hidden_size) == (
        "LlamaForCausalLM",
        5,
        64,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 8)
    assert config.tie_word_embeddings and not config.qkv_bias
    assert config.rope_scaling is None and config.rope_theta == 10000.0
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.torch_dtype == "float32"
    assert config.session_len() == 512


def test_llama_defaults_and_derived_values():
    config = ModelConfig.from_dict(LLAMA)
    assert config.head_dim == 256 // 8
    assert config.rope_theta == 500000.0
    assert not config.tie_word_embeddings and not config.qkv_bias
    assert config.torch_dtype == "bfloat16"
    assert ModelConfig.from_dict({**LLAMA, "attention_bias": True}).qkv_bias
    assert ModelConfig.from_dict({**LLAMA, "head_dim": 64}).head_dim == 64
    # No num_key_value_heads means plain multi-head attention.
    no_kv = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_dict(no_kv).num_kv_heads == 8


def test_qwen2_always_has_qkv_bias():
    assert ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias


def test_rope_parameters_written_by_transformers_5():
    config = ModelConfig.from_dict(
        {
            **LLAMA,
            "rope_theta": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        }
    )
    assert config.rope_theta == 1e6 and config.rope_scaling is None


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_llama3_and_linear_rope_scaling(key):
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = ModelConfig.from_dict({**LLAMA, key: llama3})
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    # Old configs spell the type "type".
    config = ModelConfig.from_dict({**LLAMA, key: {"type": "linear", "factor": 2.0}})
    assert config.rope_scaling == RopeScaling("linear", 2.0)


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ModelError, match="'yarn' is not supported.*'linear' and 'llama3'"):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelError, match="needs 'low_freq_factor'"):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ModelError, match="'GPT2LMHeadModel'.*LlamaForCausalLM, Mistral"):
        ModelConfig.from_dict({**LLAMA, "architectures": ["GPT2LMHeadModel"]})


def test_invalid_head_counts_and_activation_are_refused():
    with pytest.raises(ModelError, match="multiple of num_key_value_heads"):
        ModelConfig.from_dict({**LLAMA, "num_key_value_heads": 3})
    with pytest.raises(ModelError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict({**LLAMA, "hidden_act": "gelu"})
    with pytest.raises(ModelError, match="'hidden_size' must be a positive integer"):
        ModelConfig.from_dict({**LLAMA, "hidden_size": None})


def test_sliding_window_caps_the_session_length():
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 1024}
    config = ModelConfig.from_dict(mistral)
    assert config.session_len() == 1024
    assert config.session_len(512) == 512
    with pytest.raises(OptionError, match="sliding window.*session_len <= 1024"):
        config.session_len(2048)
    # Qwen2 declares a window but turns it off.
    qwen = {**mistral, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
    assert ModelConfig.from_dict(qwen).session_len() == 4096


def test_session_len_beyond_the_model_is_refused():
    config = ModelConfig.from_dict(LLAMA)
    assert config.session_len(4096) == 4096
    with pytest.raises(OptionError, match="max_position_embeddings"):
        config.session_len(4097)


def test_kv_bytes_per_block():
    config = ModelConfig.from_dict(LLAMA)
    per_token_per_layer = 2 * 2 * 32  # K and V, 2 kv heads, head_dim 32
    assert config.kv_bytes_per_block(64, "bfloat16") == 3 * per_token_per_layer * 64 * 2
    assert config.kv_bytes_per_block(16, "fp32") == 3 * per_token_per_layer * 16 * 4


def test_dtypes():
    assert canonical_dtype("bf16") == "bfloat16"
    assert canonical_dtype("torch.float16") == "float16"
    config = ModelConfig.from_dict(LLAMA)
    assert config.resolve_dtype("auto") == "bfloat16"
    assert config.resolve_dtype("fp32") == "float32"
    with pytest.raises(OptionError, match="dtype 'int4'.*float32, bfloat16 or float16"):
        config.resolve_dtype("int4")
    # transformers 5 writes "dtype" instead of "torch_dtype".
    no_torch_dtype = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    assert ModelConfig.from_dict({**no_torch_dtype, "dtype": "float16"}).torch_dtype == "float16"


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 7)


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
