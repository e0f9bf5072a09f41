"""The runner's logits against transformers' forward on the same weights (fp32, 1e-4).

Each sequence is prefilled (whole, or in two chunks), then decoded token by token
through the paged cache, several sequences per step, with physically shuffled blocks.
Every step's logits are compared with transformers' logits at the same positions.
"""

from __future__ import annotations

import pytest
import torch
from llmctl_torch import model
from llmctl_torch.model import MLP, TorchModelRunner

from llmctl.model.config import ModelConfig
from tests.helpers.tiny_models import TINY_MODELS, PagedSequences, load_hf_model

ATOL = 1e-4
DECODE_STEPS = 6


def hf_logits(model_dir, sequences):
    """transformers' fp32 logits at every position of each full sequence."""
    model = load_hf_model(model_dir)
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


def run_paged(model_dir, block_size, prompts, chunked):
    """Prefill all prompts (seq 0 in two chunks if ``chunked``), then decode greedily in
    one batch; return the final token lists and each sequence's (position, logits) pairs."""
    config = ModelConfig.from_dir(model_dir)
    runner = TorchModelRunner(model_dir, config, block_size=block_size, num_blocks=64)
    paged = PagedSequences(runner, seed=block_size)
    seqs = [paged.add(p) for p in prompts]
    observed: list[list[tuple[int, torch.Tensor]]] = [[] for _ in seqs]

    def record(counts, logits):
        for row, seq in enumerate(counts):
            observed[seq].append((paged.cached[seq] - 1, logits[row]))
            paged.tokens[seq].append(int(logits[row].argmax()))

    if chunked:
        # The first half of sequence 0 alone, then its rest together with the others.
        first = len(prompts[0]) // 2
        paged.step({0: first})
        counts = {0: len(prompts[0]) - first} | {s: len(prompts[s]) for s in seqs[1:]}
    else:
        counts = {s: len(prompts[s]) for s in seqs}
    record(counts, paged.step(counts))
    for _ in range(DECODE_STEPS):
        counts = {s: 1 for s in seqs}
        record(counts, paged.step(counts))
    return paged.tokens, observed


def random_prompts(lengths, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=generator).tolist() for n in lengths]


def assert_logits_match(model_dir, block_size, chunked=False):
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    # Lengths around block boundaries, one of them longer than the largest block.
    prompts = random_prompts([block_size + 1, 5, 2 * block_size - 3, 1, 150], vocab, block_size)
    tokens, observed = run_paged(model_dir, block_size, prompts, chunked)
    for want, seen in zip(hf_logits(model_dir, tokens), observed):
        for position, logits in seen:
            torch.testing.assert_close(logits, want[position], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_stories260k_logits_match_transformers(stories_dir, block_size):
    assert_logits_match(stories_dir, block_size, chunked=block_size == 16)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_tiny_model_logits_match_transformers(tiny_model_dir, kind, block_size):
    assert_logits_match(tiny_model_dir(kind), block_size, chunked=block_size == 32)


@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_tiny_model_logits_match_on_torchs_own_cpu_kernels(tiny_model_dir, kind, monkeypatch):
    """Where turbo's ops build, the tests above run on its attention and product kernels;
    these run on plain-torch attention and oneDNN's products, as without it."""
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "torch")
    assert_logits_match(tiny_model_dir(kind), 32, chunked=True)


@pytest.mark.parametrize("kind", ["stories260K", "qwen3"])
def test_logits_match_with_the_cpu_mlp_in_chunks(stories_dir, tiny_model_dir, kind, monkeypatch):
    """On the CPU a long prompt's MLP runs CPU_MLP_ROWS rows at a time. With chunks of 7
    rows here the prefills (200 tokens, a shorter last chunk) are chunked, and the
    logits still match transformers'."""
    model_dir = stories_dir if kind == "stories260K" else tiny_model_dir(kind)
    rows_seen: list[int] = []
    swiglu = MLP.swiglu

    def counting_swiglu(self, x):
        rows_seen.append(x.shape[0])
        return swiglu(self, x)

    monkeypatch.setattr(model, "CPU_MLP_ROWS", 7)
    monkeypatch.setattr(MLP, "swiglu", counting_swiglu)
    assert_logits_match(model_dir, 32, chunked=True)
    assert max(rows_seen) == 7 and 1 < min(rows_seen) < 7


def test_tiny_models_cover_the_family(tiny_model_dir):
    """The parametrisation above really exercises GQA, MQA, biases, untied heads, RoPE
    scaling, explicit head_dim, q/k norms and all four architectures."""
    configs = [ModelConfig.from_dir(tiny_model_dir(kind)) for kind in sorted(TINY_MODELS)]
    assert {c.architecture for c in configs} == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
    assert {c.num_kv_heads for c in configs if c.num_kv_heads < c.num_heads} >= {1, 2}
    assert any(c.qkv_bias for c in configs)
    assert any(c.qk_norm for c in configs)
    assert {c.tie_word_embeddings for c in configs} == {True, False}
    assert {c.rope_scaling.rope_type for c in configs if c.rope_scaling} == {"llama3", "linear"}
    assert any(c.head_dim * c.num_heads != c.hidden_size for c in configs)
