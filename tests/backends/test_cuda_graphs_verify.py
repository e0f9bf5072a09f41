"""Verification steps of speculative decoding and steps mixing LoRA adapters through CUDA
graphs (``llmctl.engine.runner.DecodeGraphs``: a graph per bucket of k + 1 tokens per
sequence, and graphs with per-token adapter slots) give the greedy tokens of the same
engine with graphs off, and those without speculation or of transformers + peft.

Marked ``gpu``: ``scripts/gpu_check.py`` runs them on a GPU machine. Without one, the
fixed, padded buffers these graphs read are checked with the torch runner replayed
eagerly (``tests/backends/torch/test_cuda_graphs.py``) and on the host
(``tests/engine/test_step_packing.py``).
"""

from __future__ import annotations

import pytest
import torch

from llmctl import LLM, SamplingParams
from tests.backends.test_speculative_e2e import repetitive_prompts
from tests.helpers.lora_adapters import ATTENTION, MLP, make_adapter
from tests.helpers.tiny_models import hf_greedy, load_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU"),
]
MAX_TOKENS = 32


def generate(model_dir, backend, cuda_graphs, prompts, loras=None, **options):
    """Greedy tokens of every prompt (one batch), and what the graphs served: (steps,
    verification steps, steps with an adapter); ``None`` with graphs off."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    with LLM(
        str(model_dir), backend=backend, device="cuda", dtype="float32",
        cuda_graphs=cuda_graphs, cache_block_seq_len=32, max_batch_size=8, **options,
    ) as llm:  # fmt: skip
        tokens = [o.token_ids for o in llm.generate(prompts, params, lora=loras)]
        engine = llm.engine.engine
        graphs = engine.runner.decode_graphs
        assert (graphs is not None) == cuda_graphs
        served = graphs and (graphs.replays, graphs.verify_replays, graphs.lora_replays)
        assert llm.engine.stats().kv_blocks_used == 0
    return tokens, served


@pytest.mark.parametrize("backend", ["torch", "turbo"])
@pytest.mark.parametrize("kind", ["qwen2", "mistral-one-kv-head"])
def test_ngram_verification_through_graphs_keeps_greedy_tokens(tiny_model_dir, backend, kind):
    model_dir = tiny_model_dir(kind)
    prompts = repetitive_prompts(11, 7)
    speculate = dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1)
    want, _ = generate(model_dir, backend, False, prompts)
    eager, _ = generate(model_dir, backend, False, prompts, **speculate)
    graphed, served = generate(model_dir, backend, True, prompts, **speculate)
    assert graphed == eager == want
    steps, verify_steps, _ = served
    assert verify_steps > 0 and steps > verify_steps  # both kinds of graph served steps


@pytest.mark.parametrize("backend", ["torch", "turbo"])
def test_a_batch_mixing_adapters_through_graphs_matches_peft(tiny_model_dir, tmp_path, backend):
    """Two adapters (ranks 8 and 4, different modules) and the base model in one batch,
    with max_loras 1 so the adapters swap through one slot under the same graphs; then
    the same with n-gram speculation (verification graphs with adapter slots)."""
    model_dir = tiny_model_dir("llama3-rope")
    prompts = repetitive_prompts(12, 3)
    reference = {None: hf_greedy(load_hf_model(model_dir), prompts, MAX_TOKENS)}
    paths = {}
    for seed, (name, rank, modules) in enumerate([("a8", 8, ATTENTION), ("m4", 4, MLP)]):
        paths[name] = str(tmp_path / name)
        peft_model = make_adapter(tmp_path / name, model_dir, rank=rank, target_modules=modules,
                                  seed=seed)  # fmt: skip
        reference[name] = hf_greedy(peft_model, prompts, MAX_TOKENS)
    names = [None, "a8", "m4"]
    batch = [p for p in prompts for _ in names]
    loras = [n for _ in prompts for n in names]
    want = [reference[n][i] for i in range(len(prompts)) for n in names]
    for options in (dict(max_loras=2), dict(max_loras=1),
                    dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1)):  # fmt: skip
        eager, _ = generate(model_dir, backend, False, batch, loras, lora=paths, **options)
        graphed, served = generate(model_dir, backend, True, batch, loras, lora=paths, **options)
        assert graphed == eager == want, options
        assert served[2] > 0, options  # steps with adapters replayed graphs
