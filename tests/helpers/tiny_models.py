"""Tiny Llama-family checkpoints made with transformers, and a driver for the runner.

Shared by the backend, model and plugin tests (the ``tiny_model_dir`` fixture is in
tests/conftest.py).

``make_tiny_model(directory, kind)`` writes a random HF model directory (config.json,
model.safetensors, stories260K's tokenizer files) for one of ``TINY_MODELS``. Weights are
drawn with a larger spread than transformers' init so logits span several units and
any mismatch shows up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from llmctl.engine.runner import StepBatch
from tests.conftest import STORIES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# kind → (transformers config class name, config overrides)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    # llama3 RoPE scaling with a short original context, so all three frequency bands
    # (kept, interpolated, slowed) occur; explicit head_dim != hidden / heads.
    "llama3-rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-linear-rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=4.0),
        ),
    ),
    "llama-mqa": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # Llama's optional biases: q/k/v and o (attention_bias), gate/up/down (mlp_bias).
    "llama-attention-bias": (
        "LlamaConfig",
        dict(num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False),
    ),
    "llama-mlp-bias": (
        "LlamaConfig",
        dict(num_key_value_heads=2, mlp_bias=True, tie_word_embeddings=True),
    ),
    "mistral": (
        "MistralConfig",
        dict(num_key_value_heads=2, head_dim=16, sliding_window=None, tie_word_embeddings=False),
    ),
    # Mistral with a single KV head: every query head reads the same K/V (MQA).
    "mistral-one-kv-head": (
        "MistralConfig",
        dict(num_key_value_heads=1, head_dim=16, sliding_window=None, tie_word_embeddings=False),
    ),
    # Heads of 4 floats, four kv heads to a 16-float vector: turbo's narrow decode path.
    "llama-narrow-heads": (
        "LlamaConfig",
        dict(num_attention_heads=8, num_key_value_heads=4, head_dim=4, tie_word_embeddings=True),
    ),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # Qwen3: RMSNorm on each head's q and k; no q/k/v bias; explicit head_dim.
    "qwen3": (
        "Qwen3Config",
        dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
}


def load_hf_model(model_dir: Path):
    """transformers' own model for ``model_dir`` in fp32. The class is named directly:
    the Auto classes import every architecture, which costs seconds."""
    import transformers

    architecture = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    return (
        getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    )


def make_tiny_model(directory: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """Save a random ``kind`` model (see ``TINY_MODELS``) with transformers into ``directory``."""
    import transformers

    config_class, extra = TINY_MODELS[kind]
    config = getattr(transformers, config_class)(**{**_COMMON, **extra, **overrides})
    config.architectures = [config_class.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    if STORIES.is_dir():
        for name in TOKENIZER_FILES:
            shutil.copy(STORIES / name, directory / name)
    return directory


class PagedSequences:
    """Drives a runner the way the engine does: each sequence owns blocks taken from a
    shuffled pool, so its cache is physically scattered."""

    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(runner.num_blocks, generator=generator).tolist()
        self.tokens: list[list[int]] = []
        self.cached: list[int] = []  # tokens already in the cache, per sequence
        self.blocks: list[list[int]] = []

    def add(self, prompt: list[int]) -> int:
        self.tokens.append(list(prompt))
        self.cached.append(0)
        self.blocks.append([])
        return len(self.tokens) - 1

    def step(
        self,
        new_counts: dict[int, int],
        logits_indices: list[int] | None = None,
        lora_slots: list[int] | None = None,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Run ``new_counts[seq]`` not-yet-cached tokens of each listed sequence at once;
        return the runner's logits, one row per listed sequence (or per token
        ``logits_indices`` names, as a speculative step asks); ``lora_slots``: each listed
        sequence's adapter slot (-1: none). ``greedy``: through ``execute_greedy``, which
        returns each row's argmax beside the logits."""
        bs = self.runner.block_size
        batch = StepBatch([], [], [], [], [], [], logits_indices=logits_indices)
        if lora_slots is not None:
            batch.lora_slots = np.asarray(lora_slots, dtype=np.int32)
        for seq, count in new_counts.items():
            start, end = self.cached[seq], self.cached[seq] + count
            while len(self.blocks[seq]) * bs < end:
                self.blocks[seq].append(self.free.pop())
            batch.input_ids += self.tokens[seq][start:end]
            batch.positions += list(range(start, end))
            batch.query_lens.append(count)
            batch.context_lens.append(end)
            batch.block_tables.append(list(self.blocks[seq]))
            batch.slot_mapping += [
                self.blocks[seq][p // bs] * bs + p % bs for p in range(start, end)
            ]
            self.cached[seq] = end
        return self.runner.execute_greedy(batch) if greedy else self.runner.execute(batch)


def greedy(runner, prompts: list[list[int]], steps: int, seed: int = 0) -> list[list[int]]:
    """Decode all prompts together, greedily, through the runner's paged cache: the
    first step prefills every prompt, each later one decodes a token of each."""
    paged = PagedSequences(runner, seed)
    seqs = [paged.add(p) for p in prompts]
    counts = {s: len(p) for s, p in zip(seqs, prompts)}
    for _ in range(steps):
        logits = paged.step(counts)
        for row, seq in enumerate(counts):
            paged.tokens[seq].append(int(logits[row].argmax()))
        counts = {s: 1 for s in seqs}
    return [tokens[len(p) :] for tokens, p in zip(paged.tokens, prompts)]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
