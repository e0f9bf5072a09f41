"""The shared quantize/dequantize helpers against the definition written out in plain torch,
and the KV sizing that follows from them."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.kv_cache import KVPlan
from llmctl.engine.quant import (
    FP8_MAX,
    INT8_MAX,
    SCALE_DTYPE,
    dequantize_kv,
    dequantize_weight_int8,
    kv_cache_torch_dtype,
    quantize_kv,
    quantize_weight_int8,
)
from llmctl.model.config import KV_SCALE_BYTES, ModelConfig

FP8 = torch.float8_e4m3fn


def random_rows(shape, seed, dtype=torch.float32):
    """Rows of varied spread and offset, with an outlier, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 5
    x += torch.randn(shape[:-1] + (1,), generator=g)
    x.view(-1, shape[-1])[:, 0] *= 8
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (64, 96), (344, 64)])
def test_int8_weights_per_output_channel(shape, dtype):
    w = random_rows(shape, seed=shape[0], dtype=dtype)
    q, scale = quantize_weight_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == SCALE_DTYPE and scale.shape == (shape[0],)
    # The definition, written out: scale = max|row| / 127, q = round(w / scale).
    w32 = w.float()
    expected_scale = w32.abs().amax(dim=1) / INT8_MAX
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    torch.testing.assert_close(q, torch.round(w32 / expected_scale[:, None]).to(torch.int8))
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1) == 127).all()  # the max maps to 127
    # Round trip: every element within half a step of its row (plus fp32 rounding of
    # q * scale: a few ulps of the element, which a tie at exactly half a step shows).
    back = dequantize_weight_int8(q, scale, torch.float32)
    assert ((back - w32).abs() <= scale[:, None] / 2 + 4e-7 * w32.abs()).all()
    assert dequantize_weight_int8(q, scale, dtype).dtype == dtype


def test_a_zero_row_keeps_a_usable_scale():
    w = torch.zeros(3, 8)
    w[1] = torch.linspace(-1, 1, 8)
    q, scale = quantize_weight_int8(w)
    assert scale[0] == 1 and scale[2] == 1 and (q[0] == 0).all()
    assert not dequantize_weight_int8(q, scale, torch.float32).isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kv_per_token_and_head(dtype):
    x = random_rows((5, 3, 16), seed=1, dtype=dtype)  # [tokens, kv heads, head_dim]
    q, scale = quantize_kv(x, torch.int8)
    assert q.shape == x.shape and scale.shape == (5, 3) and scale.dtype == SCALE_DTYPE
    torch.testing.assert_close(scale, x.float().abs().amax(-1) / INT8_MAX, rtol=0, atol=0)
    back = dequantize_kv(q, scale, torch.float32)
    assert ((back - x.float()).abs() <= scale[..., None] / 2 + 4e-7 * x.float().abs()).all()


def test_fp8_kv_per_token_and_head():
    x = random_rows((6, 2, 32), seed=2)
    q, scale = quantize_kv(x, FP8)
    assert q.dtype == FP8
    torch.testing.assert_close(scale, x.abs().amax(-1) / FP8_MAX, rtol=0, atol=0)
    # The definition: torch's own e4m3 rounding of x / scale (its max lands on 448).
    expected = (x / scale[..., None]).to(FP8)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each element, or of its subnormal step.
    back = dequantize_kv(q, scale, torch.float32)
    bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10)
    assert ((back - x).abs() <= bound).all()


def test_quantize_kv_refuses_a_float_target():
    with pytest.raises(ValueError, match="int8 or torch.float8_e4m3fn"):
        quantize_kv(torch.ones(2, 4), torch.bfloat16)


def test_kv_cache_dtypes():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("int8", torch.float32) == torch.int8
    assert kv_cache_torch_dtype("fp8", torch.float16) == FP8


def _config(head_dim: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 512,
            "hidden_size": 8 * head_dim,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        }
    )


def test_quantized_block_bytes_count_the_scales():
    assert KV_SCALE_BYTES == torch.finfo(SCALE_DTYPE).bits // 8
    config = _config(head_dim=64)
    rows = 2 * 3 * 4 * 16  # K and V, layers, KV heads, tokens
    assert config.kv_bytes_per_block(16, "float32") == rows * 64 * 4
    assert config.kv_bytes_per_block(16, "float32", "int8") == rows * (64 + 4)
    assert config.kv_bytes_per_block(16, "bfloat16", "fp8") == rows * (64 + 4)


def test_the_same_budget_holds_more_tokens():
    """The goal: at head_dim 64 an int8 cache holds >= 3.5x the tokens of fp32, >= 1.8x
    of bf16 (4 * 64 / 68 = 3.76, 2 * 64 / 68 = 1.88); head_dim 128 gains more."""
    for head_dim in (64, 128):
        config = _config(head_dim)
        int8 = config.kv_bytes_per_block(64, "float32", "int8")
        assert config.kv_bytes_per_block(64, "float32") / int8 >= 3.5
        assert config.kv_bytes_per_block(64, "bfloat16") / int8 >= 1.8


def test_the_plan_line_names_the_cache_element():
    plan = KVPlan(10, 64, 1024, note="capped", element="int8 + scales")
    assert plan.describe() == "10 blocks x 64 tokens = 640 tokens, 0.00 GiB (int8 + scales; capped)"
