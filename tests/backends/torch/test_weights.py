"""Loading safetensors checkpoints: single file, sharded with an index, dtype, errors."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.errors import ModelError
from llmctl.model.weights import load_weights, safetensors_files
from tests.helpers.tiny_models import load_hf_model, make_tiny_model


def test_sharded_checkpoint_loads_the_same_tensors(tiny_model_dir, tmp_path):
    single_dir = tiny_model_dir("qwen2")
    model = load_hf_model(single_dir)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    shards = safetensors_files(tmp_path)
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()

    single, sharded = load_weights(single_dir), load_weights(tmp_path)
    assert sharded.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def test_dtype_conversion(tiny_model_dir):
    weights = load_weights(tiny_model_dir("llama-mqa"), dtype=torch.bfloat16)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    reference = load_weights(tiny_model_dir("llama-mqa"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(weights[name], reference[name].bfloat16())


def test_pytorch_bin_only_says_to_convert(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelError, match="no safetensors.*pytorch_model.bin: convert it"):
        load_weights(tmp_path)


def test_missing_shard_is_named(tmp_path):
    make_tiny_model(tmp_path, "llama-mqa")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="missing: model-00002-of-00002.safetensors"):
        load_weights(tmp_path)
