"""quantization=int4 and group-wise int8 on turbo: a float safetensors checkpoint quantized
at load into GGUF blocks (``llmctl.engine.quant.quantize_weight_groups``) and run by the
block kernels that run GGUF files.

- the kernels on those blocks against float64 ``x @ W.T`` with ``W`` read back by gguf's
  own ``dequantize`` (every ISA, every group size, fresh random weights);
- tiny random models: logits against transformers on the same checkpoint with its matrices
  replaced by the dequantized blocks (only the kernels' 8-bit activations differ), and
  close to the float model itself;
- stories260K: perplexity of the fixed text and the 64-step agreements (``bench quality``);
- the rules: a bad group size, the backends that refuse, what does not apply.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from llmctl import LLM
from llmctl.bench.quality import QualitySpec, benchmark_quality
from llmctl.engine.quant import group_block_type, quantize_weight_groups
from llmctl.errors import BackendError, OptionError
from llmctl.hardware import Hardware
from llmctl.model.config import ModelConfig
from llmctl.model.gguf import GGUFBlocks
from llmctl.options import option_named
from llmctl.selection import installed_backends
from tests.conftest import STORIES
from tests.helpers.tiny_models import PagedSequences, make_tiny_model
from tests.helpers.turbo_step import hf_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMES = [(8, False), (4, False), (4, True)]  # Q8_0, Q4_0, Q4_1
TEXT = Path(__file__).resolve().parents[2] / "data" / "stories260K_quality_text.json"
CPU = Hardware(cxx_compiler="/usr/bin/c++", cpu_count=2, memory_bytes=2**34)
HOPPER = replace(CPU, cuda_available=True, compute_capability=(9, 0))


def rounded_activations(x: np.ndarray) -> np.ndarray:
    """x as the block kernels see it: per 32-block, round(x / (max|x| / 127)) * that."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    dx = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    q = np.round(blocks * np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0))
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(x.shape)


# ------------------------------------------------------------------ the kernels


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize(("bits", "zero_point"), SCHEMES)
def test_block_kernels_on_quantized_groups(turbo_ops, isa, bits, zero_point, group_size):
    """K = 384 (3 groups of 128), N = 37 (a partial 16-wide panel), rows 1-20 and 64."""
    kind = group_block_type(bits, zero_point)
    generator = torch.Generator().manual_seed(group_size + bits + zero_point)
    weight = torch.randn(37, 384, generator=generator) / 8
    weight += torch.randn(37, 1, generator=generator) / 16
    raw = quantize_weight_groups(weight, bits, group_size, zero_point)
    reference = dequantize(raw.numpy(), GGMLQuantizationType[kind]).astype(np.float64)
    packed = turbo_ops.pack_gguf_weight(raw, int(GGMLQuantizationType[kind]))
    bias = torch.randn(37, generator=generator)
    for rows in [*range(1, 21), 64]:
        x = torch.randn(rows, 384, generator=generator)
        out = torch.full((rows, 37), float("nan"))
        turbo_ops.linear(out, x, packed, bias, None)
        got = out.double().numpy()
        assert np.isfinite(got).all()
        for inputs, tolerance in ((rounded_activations(x.numpy()), 2e-5), (x.double(), 3e-2)):
            want = np.asarray(inputs) @ reference.T + bias.double().numpy()
            assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
        # Against the float weight itself: the quantization's own error, bounded.
        exact = x.double() @ weight.double().T + bias.double()
        bound = (0.02 if bits == 8 else 0.25) * exact.abs().max().item()
        assert np.abs(got - exact.numpy()).max() <= bound


# ------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module", params=["qwen2", "llama3-rope"])
def tiny_dir(request, tmp_path_factory):
    """A random model whose every matrix has inputs a multiple of 128 (qwen2: q/k/v
    biases; llama3-rope: tied embeddings, head_dim 32)."""
    directory = tmp_path_factory.mktemp(request.param)
    return make_tiny_model(directory, request.param, hidden_size=128, intermediate_size=256)


def dequantized_checkpoint(model_dir: Path, target: Path, bits, group_size, zero_point) -> Path:
    """``model_dir`` with every linear matrix quantized as turbo does at load
    (``quantize_to_blocks``) and read back by gguf's ``dequantize``: the float model
    turbo's blocks stand for."""
    from llmctl_turbo.runner import quantize_to_blocks

    shutil.copytree(model_dir, target)
    weights = load_file(model_dir / "model.safetensors")
    config = ModelConfig.from_dir(model_dir)
    transformed = quantize_to_blocks(weights, config, bits, group_size, zero_point)
    assert sum(isinstance(w, GGUFBlocks) for w in transformed.values()) == 7 * config.num_layers
    for name, weight in transformed.items():
        if isinstance(weight, GGUFBlocks):
            kind = GGMLQuantizationType[weight.tensor_type]
            matrix = dequantize(weight.data.numpy(), kind).reshape(weight.shape)
            weights[name] = torch.from_numpy(matrix).contiguous()
        else:
            weights[name] = weight
    save_file({k: v.contiguous() for k, v in weights.items()}, target / "model.safetensors")
    return target


def hf_logits_rounding_activations(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' logits with the input of every layer's linear matrix rounded as the
    block kernels round it (the LM head, a float matrix in turbo, reads its input as is)."""
    from tests.helpers.tiny_models import load_hf_model

    model = load_hf_model(model_dir)

    def round_input(module, inputs):
        x = inputs[0]
        rows = x.reshape(-1, x.shape[-1]).double().numpy()
        return (torch.from_numpy(rounded_activations(rows)).float().reshape(x.shape),)

    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(round_input)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def turbo_logits(model_dir: Path, prompt: list[int], **quantization) -> torch.Tensor:
    """The logits after ``prompt[:9]`` (a prefill), then after each next token (decodes):
    positions 8 and on."""
    from llmctl_turbo.runner import TurboModelRunner

    config = ModelConfig.from_dir(model_dir)
    runner = TurboModelRunner(model_dir, config, block_size=16, num_blocks=8, **quantization)
    driver = PagedSequences(runner, seed=1)
    seq = driver.add(prompt)
    rows = [driver.step({seq: 9})]
    rows += [driver.step({seq: 1}) for _ in range(len(prompt) - 9)]
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("bits", "group_size", "zero_point"),
    [(4, 32, True), (4, 128, False), (8, 64, False)],
)
def test_tiny_model_logits(tiny_dir, tmp_path, bits, group_size, zero_point):
    prompt = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    quantization = dict(
        quantization=f"int{bits}",
        quantization_group_size=group_size,
        quantization_zero_point=zero_point if bits == 4 else None,
    )
    got = turbo_logits(tiny_dir, prompt, **quantization)
    # The dequantized checkpoint in transformers, each layer's matrices fed the kernels'
    # 8-bit activations: turbo's blocks, read right, in every layer. (Exact to float32
    # sums on llama3-rope; on qwen2 a few activations land on the other side of a
    # rounding boundary, one 8-bit step, which its large random weights amplify.)
    reference_dir = dequantized_checkpoint(tiny_dir, tmp_path / "ref", bits, group_size, zero_point)
    reference = hf_logits_rounding_activations(reference_dir, prompt)[8:]
    spread = reference.std().item()
    assert (got - reference).abs().max().item() <= 0.1 * spread
    # The float model: quantization moves the logits, a little for int8, more for int4.
    # These random models (weights of spread 0.15) amplify every rounding: per-channel
    # int8 moves them by 3.5 % of their spread (RMS), so 4 bits (16x coarser) by ~40 %.
    float_logits = hf_logits(tiny_dir, prompt)[8:]
    rms_error = (got - float_logits).square().mean().sqrt().item() / spread
    cosine = torch.nn.functional.cosine_similarity(got, float_logits, dim=-1).min().item()
    if bits == 8:
        assert rms_error <= 0.06 and cosine >= 0.995
        assert (got.argmax(-1) == float_logits.argmax(-1)).float().mean() >= 0.85
    else:
        assert rms_error <= 0.6 and cosine >= 0.65


# ------------------------------------------------------------------ stories260K


@pytest.fixture(scope="module")
def stories_quality():
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    text = json.loads(TEXT.read_text())["token_ids"]
    flags = {"backend": "turbo", "device": "cpu", "dtype": "float32"}
    variants = [
        {"quantization": "int4"},  # groups of 32 with a zero point (Q4_1)
        {"quantization": "int4", "quantization_zero_point": False},  # Q4_0
        {"quantization": "int4", "quantization_group_size": 64},  # Q4_1, a scale per row
        {"quantization": "int8", "quantization_group_size": 32},  # Q8_0
        {"quantization": "int8"},  # per output channel
    ]
    spec = QualitySpec(text_token_ids=tuple(text))
    return benchmark_quality(str(STORIES), flags, spec, variants=variants)["runs"]


def test_stories_int4_perplexity_and_agreement(stories_quality):
    """int4 rounded by GPTQ on text the model wrote itself: perplexity of the fixed text
    +4.5 % with a zero point, +2.1 % symmetric, +2.3 % with a zero point in groups of 64
    (round-to-nearest groups: +10.0 %, +10.4 %, +9.6 %); teacher-forced top-1 agreement
    92.0 %, 90.7 % and 90.7 %. Issue 31 asked for 5 %: docs/quantization.md."""
    zero_point, symmetric, zero_point_64 = stories_quality[:3]
    for run in (zero_point, symmetric, zero_point_64):
        assert run["ratios"]["perplexity"] < 1.05
        assert run["teacher_forced_agreement"] >= 0.9
        # down_proj (172 inputs) stays float32; q/k/v, o, gate/up are 4-bit.
        assert run["ratios"]["weight_bytes"] < 0.55
    assert symmetric["ratios"]["perplexity"] < 1.035


def test_stories_group_int8_beats_per_channel_int8(stories_quality):
    groups, per_channel = stories_quality[3], stories_quality[4]
    assert abs(groups["ratios"]["perplexity"] - 1) < 0.005
    assert groups["teacher_forced_agreement"] >= 0.99
    assert groups["teacher_forced_agreement"] >= per_channel["teacher_forced_agreement"]
    assert groups["greedy_agreement"] >= per_channel["greedy_agreement"]


def test_the_log_says_what_was_quantized_and_what_was_kept(caplog, monkeypatch):
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES}")
    monkeypatch.setattr(logging.getLogger("llmctl"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="llmctl"):
        with LLM(str(STORIES), backend="turbo", device="cpu", quantization="int4"):
            pass
    assert "15 linear layers quantized to int4 (Q4_1 blocks, group 32)" in caplog.text
    assert "5 matrices kept in float32 (inputs not a multiple of 32)" in caplog.text
    assert "int4 weights rounded by GPTQ over 8192 tokens the model wrote itself" in caplog.text


# ------------------------------------------------------------------ rules


def test_a_bad_group_size_is_named():
    with pytest.raises(OptionError, match=r"quantization_group_size=48 .* not one of 32, 64, 128"):
        option_named("quantization_group_size").convert(48, "flag --quantization-group-size")


def test_each_backend_says_what_it_runs():
    backends = installed_backends()
    turbo, torch_backend = backends["turbo"], backends["torch"]
    for options in (
        {"quantization": "int4"},
        {"quantization": "int4", "quantization_group_size": 128, "quantization_zero_point": 0},
        {"quantization": "int8", "quantization_group_size": 64},
    ):
        assert turbo.option_errors({**options, "device": "cpu"}, CPU) == {}
    refused = turbo.option_errors({"quantization": "int4", "device": "cuda"}, HOPPER)
    assert "CPU block kernels only" in refused["quantization"]
    assert (
        "float16"
        in turbo.option_errors({"quantization": "int4", "device": "cpu", "dtype": "float16"}, CPU)[
            "quantization"
        ]
    )
    no_effect = turbo.option_errors({"quantization": "none", "quantization_group_size": 32}, CPU)
    assert "set quantization int4 or int8" in no_effect["quantization_group_size"]
    int8_zero = turbo.option_errors({"quantization": "int8", "quantization_zero_point": True}, CPU)
    assert "int8 groups are symmetric" in int8_zero["quantization_zero_point"]
    torch_refusal = torch_backend.option_errors({"quantization": "int4"}, CPU)["quantization"]
    assert "no int4 kernel" in torch_refusal and "--backend turbo" in torch_refusal
    groups = torch_backend.option_errors(
        {"quantization": "int8", "quantization_group_size": 32}, CPU
    )
    assert "per output channel only" in groups["quantization_group_size"]
    transformers = backends.get("transformers")
    if transformers is not None:
        errors = transformers.option_errors({"quantization": "int4"}, CPU)
        assert "--backend turbo (CPU) for int4" in errors["quantization"]


def test_int4_on_the_torch_backend_is_an_error_with_the_reason():
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES}")
    with pytest.raises(BackendError, match="no int4 kernel"):
        LLM(str(STORIES), backend="torch", device="cpu", quantization="int4")
