"""int4's calibration (``llmctl.engine.calibration``): the plain-torch forward pass against
transformers on the same random checkpoints (every Llama-family kind the engines run),
the input moments against the inputs transformers' own modules receive, and the text the
model writes itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmctl.engine.calibration import (
    MATRIX_INPUTS,
    FloatModel,
    layer_input_moments,
    self_written_tokens,
)
from llmctl.model.config import ModelConfig
from llmctl.model.weights import load_weights
from tests.helpers.tiny_models import load_hf_model, make_tiny_model

KINDS = ["llama3-rope", "llama-attention-bias", "llama-mqa", "mistral", "qwen2", "qwen3"]


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (batch, length), generator=generator)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_transformers(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    model = FloatModel(load_weights(model_dir, torch.float32), ModelConfig.from_dir(model_dir))
    ids = tokens(3, 40)
    with torch.inference_mode():
        want = load_hf_model(model_dir)(ids).logits
        got = model.forward(ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_forward_with_a_sliding_window_shorter_than_the_text(tmp_path):
    """Mistral's window: each position sees only the last ``sliding_window`` keys."""
    model_dir = make_tiny_model(tmp_path, "mistral", sliding_window=8)
    config = ModelConfig.from_dir(model_dir)
    assert config.sliding_window == 8
    model = FloatModel(load_weights(model_dir, torch.float32), config)
    ids = tokens(2, 30, seed=1)
    with torch.inference_mode():
        want = load_hf_model(model_dir)(ids).logits
        got = model.forward(ids)
        unwindowed = FloatModel(model.weights, replace(config, sliding_window=None))
        assert not torch.allclose(unwindowed.forward(ids), want, atol=1e-3)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind", ["llama-attention-bias", "qwen3"])
def test_moments_are_those_of_the_inputs_transformers_feeds_each_matrix(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    config = ModelConfig.from_dir(model_dir)
    hf = load_hf_model(model_dir)
    ids = tokens(2, 24, seed=2)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in hf.named_modules():
        if name.endswith(tuple(MATRIX_INPUTS)):

            def keep(_module, args, name=name):
                seen[f"{name}.weight"] = args[0].reshape(-1, args[0].shape[-1]).double()

            hooks.append(module.register_forward_pre_hook(keep))
    with torch.inference_mode():
        hf(ids)
    for hook in hooks:
        hook.remove()
    layers = list(layer_input_moments(load_weights(model_dir, torch.float32), config, ids))
    assert len(layers) == config.num_layers
    names = {name for layer in layers for name in layer}
    assert names == set(seen) and len(names) == 7 * config.num_layers
    for layer in layers:
        for name, hessian in layer.items():
            x = seen[name]
            torch.testing.assert_close(hessian.double(), x.T @ x / len(x), atol=1e-4, rtol=1e-4)


def test_the_model_writes_its_own_text(tiny_model_dir):
    """From BOS, no end-of-sequence token, the same text for the same seed, and the
    model's own distribution: each token is likelier under the model than under a
    uniform draw, on average."""
    model_dir = tiny_model_dir("qwen2")
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, torch.float32)
    text = self_written_tokens(weights, config, sequences=4, length=48, seed=7)
    assert text.shape == (4, 48) and (text[:, 0] == config.bos_token_id).all()
    assert not torch.isin(text, torch.tensor(config.eos_token_ids)).any()
    assert torch.equal(text, self_written_tokens(weights, config, sequences=4, length=48, seed=7))
    assert not torch.equal(text, self_written_tokens(weights, config, sequences=4, length=48))
    with torch.inference_mode():
        logprobs = torch.log_softmax(FloatModel(weights, config).forward(text[:, :-1]), -1)
    chosen = logprobs.gather(-1, text[:, 1:, None]).mean()
    assert chosen > logprobs.mean() + 0.5
