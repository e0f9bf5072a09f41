"""LoRA adapters on the torch and turbo backends, through the Python API: batched beside
the base weights, chosen per prompt, against transformers + peft on the same adapters."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.quant import dequantize_weight_int8, quantize_weight_int8
from llmctl.engine.runner import PagedRunner
from llmctl.errors import BackendError, InvalidRequest, ModelError
from llmctl.hardware import Hardware
from tests.helpers.lora_adapters import ATTENTION, MLP, make_adapter
from tests.helpers.tiny_models import hf_greedy, load_hf_model

# Both backends that serve adapters: torch (turbo's lora_add on the CPU, Triton on CUDA) and
# turbo (its native LoRA kernels inside its one-call step).
BACKENDS = ["torch", "turbo"]

MAX_TOKENS = 12
# A shared prefix longer than a block (16 tokens): the prefix cache holds it after the
# first request, and must not hand one adapter's K/V to another.
PREFIX = [5, 77, 301, 42, 9, 250, 13, 404, 88, 61, 7, 199, 23, 310, 64, 3, 120, 45]
PROMPTS = [PREFIX + [11], PREFIX + [12, 90], [30, 31, 32], PREFIX + [11]]

# name -> (rank, target modules, rsLoRA): different ranks, modules, scalings
ADAPTERS = {
    "attn8": (8, ATTENTION, False),
    "mlp4": (4, MLP, False),
    "all16": (16, ATTENTION + MLP, True),
    "qv2": (2, ["q_proj", "v_proj"], False),
}


@pytest.fixture(scope="module", params=["llama3-rope", "qwen2"])
def served(request, tiny_model_dir, tmp_path_factory):
    """A tiny model, four adapters of it, and each one's reference (transformers + peft)
    greedy tokens for every prompt (``None``: the base model)."""
    model_dir = tiny_model_dir(request.param)
    root = tmp_path_factory.mktemp(f"adapters-{request.param}")
    paths, want = {}, {None: hf_greedy(load_hf_model(model_dir), PROMPTS, MAX_TOKENS)}
    for seed, (name, (rank, modules, rslora)) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        peft_model = make_adapter(
            root / name, model_dir, rank=rank, target_modules=modules, use_rslora=rslora, seed=seed
        )
        want[name] = hf_greedy(peft_model, PROMPTS, MAX_TOKENS)
        assert want[name] != want[None], f"{name} must change the output to be tested"
    return model_dir, paths, want


def greedy(llm: LLM, names: list[str | None]) -> list[list[int]]:
    """Each (adapter, prompt) pair in one generate call: one mixed batch."""
    prompts = [p for _ in names for p in PROMPTS]
    loras = [n for n in names for _ in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora=loras)
    tokens = [o.token_ids for o in outs]
    return [tokens[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] for i in range(len(names))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_loras", [4, 1])
def test_a_mixed_batch_of_adapters_matches_peft(served, max_loras, backend):
    """Four adapters and the base model in one batch; with max_loras 1 the adapters take
    turns in the one slot (swapped in least-recently-used), and stay correct."""
    model_dir, paths, want = served
    names = [None, *ADAPTERS, None]
    with LLM(
        str(model_dir), backend=backend, lora=paths, max_loras=max_loras, cache_block_seq_len=16,
        max_lora_rank=16,
    ) as llm:  # fmt: skip
        got = greedy(llm, names)
        for name, tokens in zip(names, got):
            assert tokens == want[name], name
        # Again, one at a time: the prefix cache holds PREFIX's blocks now, per adapter.
        for name in names:
            assert greedy(llm, [name]) == [want[name]], name
        if max_loras == 1:
            assert llm.engine.engine.loras.num_loads >= len(ADAPTERS)
        assert llm.engine.engine.block_size == 16  # adapters never change the block size


def test_adapters_match_peft_beside_the_cpu_mlp_in_chunks(served, monkeypatch):
    """On the CPU the torch backend runs a long prompt's MLP CPU_MLP_ROWS rows at a time,
    but not a step with adapters, whose rows are grouped over the whole step. With chunks
    of 4 rows here, steps of both kinds still match peft."""
    from llmctl_torch import model

    monkeypatch.setattr(model, "CPU_MLP_ROWS", 4)
    model_dir, paths, want = served
    names = [None, "mlp4", "all16", None]
    with LLM(str(model_dir), backend="torch", lora=paths, cache_block_seq_len=16) as llm:
        for name, tokens in zip(names, greedy(llm, names)):
            assert tokens == want[name], name
        assert greedy(llm, [None]) == [want[None]]  # no adapter in the step: chunked


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapter_slots_are_allocated_before_the_kv_cache(served, backend, monkeypatch):
    """Adapters served from the start get their slots before the KV cache is sized, so
    the cache leaves their memory free (on a GPU the plan reads what is free); with none,
    the first run-time load allocates them, and they then serve correctly."""
    model_dir, paths, want = served
    slots_when_cache_allocated = []
    allocate = PagedRunner.allocate_kv_cache

    def watched(runner: PagedRunner, num_blocks: int) -> None:
        slots_when_cache_allocated.append(runner.loras is not None)
        allocate(runner, num_blocks)

    monkeypatch.setattr(PagedRunner, "allocate_kv_cache", watched)
    with LLM(str(model_dir), backend=backend, lora={"mlp4": paths["mlp4"]}) as llm:
        assert slots_when_cache_allocated == [True]
        assert greedy(llm, ["mlp4"]) == [want["mlp4"]]
    with LLM(str(model_dir), backend=backend) as llm:
        assert slots_when_cache_allocated == [True, False]
        assert llm.engine.engine.runner.loras is None
        llm.load_lora("attn8", paths["attn8"])
        assert greedy(llm, ["attn8", None]) == [want["attn8"], want[None]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixed_batch_of_adapters_on_cuda_matches_peft(served, backend):
    """The same mixed batch on the GPU (torch: its Triton kernels; turbo: csrc/cuda/lora.cu
    inside its CUDA step), in float32 so that greedy tokens match transformers + peft on
    the CPU; with max_loras 2 the adapters swap through the device's slots."""
    model_dir, paths, want = served
    names = [None, *ADAPTERS, None]
    with LLM(
        str(model_dir), backend=backend, lora=paths, max_loras=2, cache_block_seq_len=32,
        max_lora_rank=16, device="cuda", dtype="float32",
    ) as llm:  # fmt: skip
        got = greedy(llm, names)
        for name, tokens in zip(names, got):
            assert tokens == want[name], name


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_with_ngram_speculation_match_peft(served, backend):
    """Speculative steps verify proposals with the adapter of their row."""
    model_dir, paths, want = served
    with LLM(
        str(model_dir), backend=backend, lora=paths, cache_block_seq_len=16,
        speculative_method="ngram",
    ) as llm:  # fmt: skip
        names = [None, *ADAPTERS]
        assert greedy(llm, names) == [want[name] for name in names]


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_load_and_unload_at_run_time(served, backend):
    model_dir, paths, want = served
    with LLM(str(model_dir), backend=backend, cache_block_seq_len=16) as llm:
        llm.load_lora("late", paths["all16"])
        assert greedy(llm, ["late", None]) == [want["all16"], want[None]]
        llm.unload_lora("late")
        with pytest.raises(InvalidRequest, match="'late' is not loaded"):
            greedy(llm, ["late"])
        llm.load_lora("late", paths["mlp4"])  # the name again, other weights: no stale cache
        assert greedy(llm, ["late"]) == [want["mlp4"]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_adapters_are_refused_with_the_reason(served, tiny_model_dir, tmp_path, backend):
    model_dir, paths, _ = served
    # A model of other shapes (q_proj [64, 64] against [128, 64]).
    other = tiny_model_dir("qwen2" if "llama3" in model_dir.name else "llama3-rope")
    make_adapter(tmp_path / "other", other, rank=4, target_modules=ATTENTION)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with LLM(str(model_dir), backend=backend, max_lora_rank=8) as llm:
        cases = [
            ("a", paths["all16"], "rank 16, above max_lora_rank 8.*--max-lora-rank 16"),
            ("a", str(tmp_path / "other"), "do not fit the base model's.*another model"),
            ("a", str(tmp_path / "missing"), "does not exist"),
            ("a", str(broken), "truncated or not a safetensors file"),
            (llm.engine.model_name, paths["attn8"], "is the base model's name"),
        ]
        for name, path, message in cases:
            with pytest.raises(ModelError, match=message):
                llm.load_lora(name, path)
        llm.load_lora("a", paths["attn8"])
        with pytest.raises(ModelError, match="'a' is already loaded"):
            llm.load_lora("a", paths["mlp4"])
        with pytest.raises(InvalidRequest, match="'nope' is not loaded"):
            llm.generate([[1, 2, 3]], lora="nope")
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def int8_reference(model_dir, adapter_dir=None):
    """transformers (+ peft with ``adapter_dir``) on the int8 weights the backends run:
    each adapted projection's weight quantized as ``quantization=int8`` does (per output
    channel) and dequantized, the adapter on top."""
    import torch
    from peft import PeftModel

    model = load_hf_model(model_dir)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(tuple(ATTENTION + MLP)):
                weight = module.weight
                weight.copy_(dequantize_weight_int8(*quantize_weight_int8(weight), weight.dtype))
    return PeftModel.from_pretrained(model, adapter_dir).eval() if adapter_dir else model


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_on_int8_weights_match_peft_on_the_dequantized_weights(served, backend):
    """quantization=int8: the adapters add to the int8 product, and the greedy tokens equal
    peft's on the dequantized weights exactly (no tolerance). turbo's int8 kernels compute
    in fp32 from the int8 weights and scales; torch's CPU products of more than 8 rows
    (here every step: 12 sequences) dequantize the int8 weight, also in fp32. (Its
    bfloat16-activation kernel for fewer rows is bounded in test_int8_linear.py.)"""
    model_dir, paths, _ = served
    names = ["all16", "mlp4", None]
    want = {
        name: hf_greedy(int8_reference(model_dir, paths.get(name)), PROMPTS, MAX_TOKENS)
        for name in names
    }
    assert want["all16"] != want[None]
    with LLM(
        str(model_dir), backend=backend, lora={n: paths[n] for n in names if n},
        quantization="int8", cache_block_seq_len=16,
    ) as llm:  # fmt: skip
        assert greedy(llm, names) == [want[name] for name in names]


def test_transformers_refuses_adapters_and_turbo_on_cuda_checks_them(served):
    """transformers serves no adapters; turbo's rule takes them on CUDA as on the CPU
    (csrc/cuda/lora.cu) and checks each one against the model."""
    from llmctl_turbo.config import RULES

    model_dir, paths, _ = served
    with pytest.raises(BackendError, match="--backend torch"):
        LLM(str(model_dir), backend="transformers", lora={"a": paths["attn8"]})
    (rule,) = [rule for rule in RULES if rule.option == "lora"]
    cuda = Hardware(cuda_available=True, compute_capability=(9, 0))
    options = {"model": str(model_dir), "device": "cuda", "max_lora_rank": 8}
    assert rule.refuses({"a": paths["attn8"]}, options, cuda) is None
    assert rule.refuses({}, options, cuda) is None
    assert "above max_lora_rank 8" in rule.refuses({"a": paths["all16"]}, options, cuda)
    with LLM(str(model_dir), backend="transformers") as llm:
        with pytest.raises(InvalidRequest, match="serves no LoRA adapters"):
            llm.generate([[1, 2, 3]], lora="a")


def test_turbo_adapters_with_an_mlp_of_partial_panels(tmp_path):
    """intermediate_size 100 is not a whole number of turbo's 16-feature panels: up's
    columns then start after gate's padded panels in the step's gate/up buffer."""
    from tests.helpers.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", "qwen2", intermediate_size=100)
    peft_model = make_adapter(tmp_path / "mlp", model_dir, rank=8, target_modules=MLP)
    want = hf_greedy(peft_model, PROMPTS, MAX_TOKENS)
    assert want != hf_greedy(load_hf_model(model_dir), PROMPTS, MAX_TOKENS)
    with LLM(str(model_dir), backend="turbo", lora={"mlp": str(tmp_path / "mlp")}) as llm:
        assert greedy(llm, ["mlp"]) == [want]
