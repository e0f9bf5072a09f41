"""The inputs a model's linear layers see, measured on text the model writes itself.

``quantization=int4`` rounds each matrix with GPTQ (``llmctl.engine.quant``), which needs
the second moments of the matrix's inputs, ``H = E[x xᵀ]`` (``[in, in]``; q/k/v share
theirs, as gate/up do). With no data set at hand, the model writes one: from its BOS token
it samples ``sequences`` texts of ``length`` tokens in its float weights (temperature 1,
a fixed seed, so a load quantizes the same way each time; end-of-sequence tokens masked,
so every text runs its length). A second pass over those texts gives the moments one
layer at a time (``layer_input_moments``), so memory holds one layer's ``H`` at once.

Plain torch over the checkpoint's tensors as transformers names them, for the Llama
family (Llama, Mistral, Qwen2, Qwen3), with transformers' arithmetic: the tests compare
its logits with transformers' own. Matrices multiply in the checkpoint's dtype; norms,
softmax and the moments are float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from llmctl.engine.rope import rope_inv_freq
from llmctl.model.config import ModelConfig

# 8,192 tokens, a few seconds' writing for a small model. On stories260K GPTQ's cost on
# held-out text was the same from 2,048 tokens to 16,384 (docs/quantization.md).
CALIBRATION_SEQUENCES = 32
CALIBRATION_LENGTH = 256
CALIBRATION_SEED = 0

# Which input each linear matrix of a layer reads (``layer_input_moments``' keys).
MATRIX_INPUTS = {
    "self_attn.q_proj": "attention",
    "self_attn.k_proj": "attention",
    "self_attn.v_proj": "attention",
    "self_attn.o_proj": "attention_output",
    "mlp.gate_proj": "mlp",
    "mlp.up_proj": "mlp",
    "mlp.down_proj": "mlp_activation",
}

Record = Callable[[str, torch.Tensor], None]


class FloatModel:
    """The checkpoint's forward pass, a layer at a time, with an optional KV cache."""

    def __init__(self, weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
        self.weights = weights
        self.config = config
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = self.weights[f"{name}.weight"]
        bias = self.weights.get(f"{name}.bias")
        return F.linear(x.to(weight.dtype), weight, bias).float()

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.weights[name].float() * x

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE as transformers applies it: the halves of each head rotated together."""
        angles = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos(), angles.sin()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weights["model.embed_tokens.weight"][tokens].float()

    def layer(
        self,
        index: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        record: Record | None = None,
    ) -> torch.Tensor:
        """``hidden [B, T, hidden]`` at ``positions [T]`` through layer ``index``. ``cache``
        (``new_cache``) keeps the layer's K and V for later positions; ``record(input, x)``
        sees each input a linear matrix reads (``MATRIX_INPUTS``' values)."""
        config, prefix = self.config, f"model.layers.{index}."
        batch, length = hidden.shape[:2]
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim

        def heads_of(x: torch.Tensor, count: int) -> torch.Tensor:
            return x.view(batch, length, count, head_dim).transpose(1, 2)

        x = self._norm(hidden, prefix + "input_layernorm.weight")
        if record:
            record("attention", x)
        q = heads_of(self._linear(x, prefix + "self_attn.q_proj"), heads)
        k = heads_of(self._linear(x, prefix + "self_attn.k_proj"), kv_heads)
        v = heads_of(self._linear(x, prefix + "self_attn.v_proj"), kv_heads)
        if config.qk_norm:  # Qwen3: each head's q and k normalised before RoPE
            q = self._norm(q, prefix + "self_attn.q_norm.weight")
            k = self._norm(k, prefix + "self_attn.k_norm.weight")
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        if cache is not None:  # (K, V) with room for every position, filled as it goes
            filled = int(positions[-1]) + 1
            cache[0][:, :, positions] = k
            cache[1][:, :, positions] = v
            k, v = cache[0][:, :, :filled], cache[1][:, :, :filled]
        key_positions = torch.arange(k.shape[2])
        allowed = key_positions[None, :] <= positions[:, None]
        if config.sliding_window:
            allowed &= positions[:, None] - key_positions[None, :] < config.sliding_window
        # A KV head's group of query heads as one longer run of queries against its keys.
        group = heads // kv_heads
        grouped = q.reshape(batch, kv_heads, group * length, head_dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=allowed.repeat(group, 1))
        out = out.view(batch, heads, length, head_dim)
        out = out.transpose(1, 2).reshape(batch, length, heads * head_dim)
        if record:
            record("attention_output", out)
        hidden = hidden + self._linear(out, prefix + "self_attn.o_proj")
        x = self._norm(hidden, prefix + "post_attention_layernorm.weight")
        if record:
            record("mlp", x)
        mlp = prefix + "mlp."
        activation = F.silu(self._linear(x, mlp + "gate_proj")) * self._linear(x, mlp + "up_proj")
        if record:
            record("mlp_activation", activation)
        return hidden + self._linear(activation, mlp + "down_proj")

    def new_cache(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V for ``length`` positions of ``batch`` sequences."""
        shape = (batch, self.config.num_kv_heads, length, self.config.head_dim)
        return torch.empty(shape), torch.empty(shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = "model.embed_tokens" if self.config.tie_word_embeddings else "lm_head"
        return self._linear(self._norm(hidden, "model.norm.weight"), head)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of ``tokens [B, T]`` from position 0."""
        hidden, positions = self.embed(tokens), torch.arange(tokens.shape[1])
        for index in range(self.config.num_layers):
            hidden = self.layer(index, hidden, positions)
        return self.logits(hidden)


@torch.inference_mode()
def self_written_tokens(
    weights: dict[str, torch.Tensor],
    config: ModelConfig,
    sequences: int = CALIBRATION_SEQUENCES,
    length: int = CALIBRATION_LENGTH,
    seed: int = CALIBRATION_SEED,
    progress: Callable[[range], Iterator[int]] = iter,
) -> torch.Tensor:
    """``[sequences, length]`` token ids the model samples from its BOS token (or, with
    none, its first end-of-sequence token), every end-of-sequence token masked.
    ``progress`` wraps the loop over positions (a rich progress bar, say)."""
    model = FloatModel(weights, config)
    first = config.bos_token_id
    if first is None:
        first = config.eos_token_ids[0] if config.eos_token_ids else 0
    tokens = torch.full((sequences, length), first, dtype=torch.long)
    caches = [model.new_cache(sequences, length) for _ in range(config.num_layers)]
    generator = torch.Generator().manual_seed(seed)
    banned = [t for t in config.eos_token_ids if t < config.vocab_size]
    for position in progress(range(length - 1)):
        hidden = model.embed(tokens[:, position : position + 1])
        positions = torch.tensor([position])
        for index, cache in enumerate(caches):
            hidden = model.layer(index, hidden, positions, cache)
        logits = model.logits(hidden)[:, -1]
        logits[:, banned] = float("-inf")
        probs = torch.softmax(logits, -1)
        tokens[:, position + 1] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens


@torch.inference_mode()
def layer_input_moments(
    weights: dict[str, torch.Tensor], config: ModelConfig, tokens: torch.Tensor
) -> Iterator[dict[str, torch.Tensor]]:
    """For each layer in turn, ``{matrix weight name: H}``: the float32 second moments
    ``E[x xᵀ]`` of the inputs that matrix reads over ``tokens [B, T]``, the layers before
    in the checkpoint's float weights."""
    model = FloatModel(weights, config)
    hidden, positions = model.embed(tokens), torch.arange(tokens.shape[1])
    moments: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1])
        moments[name] = rows.T @ rows / rows.shape[0]

    for index in range(config.num_layers):
        hidden = model.layer(index, hidden, positions, record=record)
        prefix = f"model.layers.{index}."
        yield {f"{prefix}{matrix}.weight": moments[x] for matrix, x in MATRIX_INPUTS.items()}
