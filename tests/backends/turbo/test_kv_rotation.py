"""The int8 KV cache's rotation (``llmctl.engine.quant.kv_rotation``): every head's q, k
and v rows multiplied by an orthonormal Hadamard matrix after RoPE, in both backends.

- the matrix: symmetric, ``H @ H = I``, entries +-1/sqrt(D); none unless D is a power of 2;
- the cache bytes: a token's layer-0 key, computed by transformers (position 0: RoPE is
  the identity), is stored as ``quantize_kv(k @ H)`` by turbo and by the torch backend;
- the quality it buys on stories260K (16 prompts x 64 free-running greedy steps, as
  ``bench quality`` measures): at least bfloat16 weights' agreement with float32, in the
  same run, on each backend.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.bench.quality import QualitySpec, benchmark_quality
from llmctl.engine.quant import kv_rotation, quantize_kv
from tests.conftest import STORIES
from tests.helpers.tiny_models import load_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = Path(__file__).resolve().parents[2] / "data" / "stories260K_quality_text.json"


@pytest.mark.parametrize("head_dim", [2, 8, 64, 128, 256])
def test_the_rotation_is_an_orthonormal_symmetric_hadamard(head_dim):
    h = kv_rotation(head_dim, torch.float64, "cpu")
    assert h.shape == (head_dim, head_dim)
    torch.testing.assert_close(h @ h, torch.eye(head_dim, dtype=torch.float64))
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(head_dim)))
    assert kv_rotation(head_dim, torch.bfloat16, "cpu").dtype == torch.bfloat16


@pytest.mark.parametrize("head_dim", [1, 6, 80, 96])
def test_no_rotation_unless_a_power_of_two(head_dim):
    assert kv_rotation(head_dim, torch.float32, "cpu") is None


def needs_stories() -> None:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")


def first_key(prompt: list[int]) -> torch.Tensor:
    """Layer 0's key of the prompt's first token, [kv_heads, head_dim], by transformers."""
    model = load_hf_model(STORIES)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens.weight[prompt[0]])
        key = attention.k_proj(x)
    return key.view(-1, model.config.head_dim)


def layer0_keys(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of layer 0's K cache, [slots, kv_heads, head_dim] int8, and scales."""
    runner = llm.engine.engine.runner
    if hasattr(runner, "kv_caches"):  # the torch backend: a (K, V, scales) per layer
        cache = runner.kv_caches[0]
        keys, scales = cache.k, cache.scales[0]
    else:  # turbo: [layers, 2, blocks, block_size, kv_heads, head_dim]
        keys, scales = runner.kv_cache[0, 0], runner.kv_cache_scale[0, 0]
    return keys.reshape(-1, *keys.shape[-2:]), scales.reshape(-1, scales.shape[-1])


@pytest.mark.parametrize("backend", ["turbo", "torch"])
def test_the_cache_holds_the_rotated_key(turbo_ops, backend):
    needs_stories()
    with LLM(str(STORIES), backend=backend, device="cpu", dtype="float32",
             kv_cache_dtype="int8", enable_prefix_caching=False) as llm:  # fmt: skip
        prompt = llm.engine.tokenizer.encode("Once upon a time")
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        keys, scales = layer0_keys(llm)
    key = first_key(prompt)
    rotation = kv_rotation(key.shape[-1], torch.float32, "cpu")
    want, want_scale = quantize_kv(key @ rotation, torch.int8)
    plain, _ = quantize_kv(key, torch.int8)
    distance = (keys.int() - want.int()).abs().amax((-2, -1))
    slot = int(distance.argmin())
    # float32 sums in another order may move a value across a rounding boundary: one step.
    assert distance[slot] <= 1
    torch.testing.assert_close(scales[slot], want_scale, rtol=1e-5, atol=1e-7)
    assert (keys[slot].int() - plain.int()).abs().max() > 1  # not the unrotated bytes


@pytest.fixture(scope="module")
def stories_runs(turbo_ops):
    needs_stories()
    text = json.loads(TEXT.read_text())["token_ids"]
    spec = QualitySpec(text_token_ids=tuple(text))
    variants = [{"kv_cache_dtype": "int8"}, {"dtype": "bfloat16"}]
    return {
        backend: benchmark_quality(
            str(STORIES),
            {"backend": backend, "device": "cpu", "dtype": "float32"},
            spec,
            variants=variants,
        )["runs"]  # fmt: skip
        for backend in ("turbo", "torch")
    }


@pytest.mark.parametrize("backend", ["turbo", "torch"])
def test_the_int8_cache_is_as_faithful_as_bfloat16_weights(stories_runs, backend):
    """Measured here: without the rotation an int8 cache agreed on 70.0 % of greedy steps
    (teacher-forced 98.8 %); with it 84.8 % (99.3 %), against bfloat16 weights' 81.6 % on
    turbo and 77.6 % on torch (99.4 %, 99.3 %)."""
    int8_cache, bf16_weights = stories_runs[backend]
    assert int8_cache["greedy_agreement"] >= bf16_weights["greedy_agreement"]
    assert int8_cache["teacher_forced_agreement"] >= 0.99
    assert abs(int8_cache["ratios"]["perplexity"] - 1) < 0.01


def test_both_backends_agree_on_the_rotated_cache(stories_runs):
    turbo, torch_runs = stories_runs["turbo"][0], stories_runs["torch"][0]
    assert turbo["first_differences"] == torch_runs["first_differences"]
