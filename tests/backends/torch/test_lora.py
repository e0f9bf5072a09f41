"""LoRA adapters merged at load, against transformers with the merge done by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch
from llmctl_torch.runner import TorchModelRunner
from safetensors.torch import save_file

from llmctl.errors import ModelError, OptionError
from llmctl.model.config import ModelConfig
from tests.helpers.tiny_models import PagedSequences, load_hf_model

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def write_adapter(directory, model, rank=4, alpha=8.0, seed=0, **config_extra):
    """A random PEFT LoRA adapter for ``model`` (transformers); returns its A/B per module."""
    generator = torch.Generator().manual_seed(seed)
    pairs, tensors = {}, {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in TARGETS:
            out_features, in_features = module.weight.shape
            a = torch.randn(rank, in_features, generator=generator) * 0.3
            b = torch.randn(out_features, rank, generator=generator) * 0.3
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            pairs[name] = (a, b)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(TARGETS),
        "bias": "none",
        **config_extra,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return pairs


def runner_logits(model_dir, adapters, prompt):
    runner = TorchModelRunner(
        model_dir, ModelConfig.from_dir(model_dir), block_size=16, num_blocks=8, adapters=adapters
    )
    paged = PagedSequences(runner)
    paged.add(prompt)
    return paged.step({0: len(prompt)})[0]


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merged_adapter_matches_transformers_with_the_delta_added(
    tiny_model_dir, tmp_path, use_rslora
):
    model_dir = tiny_model_dir("llama3-rope")
    model = load_hf_model(model_dir)
    pairs = write_adapter(tmp_path / "adapter", model, use_rslora=use_rslora)
    scale = 8.0 / math.sqrt(4) if use_rslora else 8.0 / 4
    prompt = [1, 17, 250, 33, 400, 9, 77]
    with torch.no_grad():
        base = model(torch.tensor([prompt])).logits[0, -1]
        modules = dict(model.named_modules())
        for name, (a, b) in pairs.items():
            modules[name].weight += (b.double() @ a.double() * scale).float()
        want = model(torch.tensor([prompt])).logits[0, -1]
    got = runner_logits(model_dir, [tmp_path / "adapter"], prompt)
    assert (want - base).abs().max() > 0.5  # the adapter matters
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_more_than_one_adapter_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(OptionError, match="one LoRA adapter.*got 2"):
        runner_logits(tiny_model_dir("llama3-rope"), [tmp_path / "a", tmp_path / "b"], [1])


def test_unsupported_adapters_are_refused_with_the_reason(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama3-rope")
    model = load_hf_model(model_dir)
    write_adapter(tmp_path / "dora", model, use_dora=True)
    with pytest.raises(ModelError, match="use_dora: DoRA adapters are not supported"):
        runner_logits(model_dir, [tmp_path / "dora"], [1])
    with pytest.raises(ModelError, match="no adapter_config.json"):
        runner_logits(model_dir, [tmp_path / "missing"], [1])


def test_adapter_for_another_model_is_refused(tiny_model_dir, tmp_path):
    other = load_hf_model(tiny_model_dir("mistral"))  # different head layout
    write_adapter(tmp_path / "adapter", other)
    with pytest.raises(ModelError, match="do not fit the base weight"):
        runner_logits(tiny_model_dir("llama3-rope"), [tmp_path / "adapter"], [1])
