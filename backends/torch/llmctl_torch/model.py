"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch, over a paged KV cache.

It follows transformers' math step for step (RMSNorm in fp32, rotate-half RoPE, SwiGLU)
so that logits match it to rounding. Two changes for speed, as in nano-vllm: q/k/v and
gate/up projections are each one matmul (``qkv_proj``, ``gate_up_proj``), and the
forward runs on the flattened batch of new tokens, reading past tokens from the cache.
HF checkpoints load directly: ``to_model_state`` merges their separate projections.

``TorchModelRunner`` (at the end) is the torch backend's ``ModelRunner`` for the shared
engine. It loads the model, owns the paged KV cache, and runs one scheduler step: the step's
lists become one tensor, copied to the device once (``stage_step``); the model writes
the new tokens' K/V and returns the logits of each sequence's last new token (or, in a
speculative step, of the tokens ``logits_indices`` names).

On a GPU, decode steps replay CUDA graphs captured when the cache is allocated (see
``llmctl.engine.runner.DecodeGraphs``), and so do the verification steps of speculative
decoding (up to k + 1 tokens per sequence); longer prefill and mixed steps run eagerly.
LoRA adapters (``llmctl_torch.lora``: batched, never merged) sit in slots allocated when
the first adapter is put in one; graphs with per-token adapter slots are captured at the
first step that uses one, and serve every adapter put in a slot afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.engine.lora import LoraWeights, read_lora_weights
from llmctl.engine.quant import SCALE_DTYPE, is_quantized_kv, kv_rotation
from llmctl.engine.rope import rope_inv_freq
from llmctl.engine.runner import PagedRunner, StepBatch, StepInputs
from llmctl.errors import ModelError
from llmctl.model.config import ModelConfig
from llmctl.model.lora import AdapterSpec
from llmctl.model.weights import load_weights
from llmctl_torch.attention import AttentionOps, LayerCache, attention_ops
from llmctl_torch.cpu_threads import ONE_THREAD_STEP_ELEMENTS, one_thread_step
from llmctl_torch.linear import NATIVE_DTYPES, Linear, dense_linear, quantize_linears
from llmctl_torch.lora import ModelLoras

# Merged parameter of each layer → the HF parameters concatenated (output dim) to form it.
MERGED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass
class AttentionMetadata:
    """Where the batch's new tokens go in the KV cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: tokens in cache after this step
    query_start_loc: torch.Tensor  # [B + 1] int32: offsets of each sequence's new tokens
    is_decode: bool  # every sequence has exactly one new token


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in fp32, round to the input dtype, then scale.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Created on the CPU explicitly so that building the model on "meta" keeps it real.
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin ``[T, head_dim]`` for the given positions, in ``dtype``.

        The sin's first half is negated so that ``apply_rotary`` can use one ``roll``
        instead of transformers' slice-negate-concatenate; the products are the same.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, H, D]`` by the per-token angles (rotate-half layout, as HF Llama):
    ``x * cos + concat(-x2, x1) * sin``, written as a roll of the halves."""
    rotated_halves = x.roll(x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rotated_halves * signed_sin[:, None, :]


class Attention(nn.Module):
    """Self-attention over this layer's slice of the paged KV cache, which it owns (as in
    nano-vllm): the runner hands it the slice and the attention ops once it has
    allocated the cache (``bind``), so the model's forward carries only the batch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.cache: LayerCache | None = None
        self.ops: AttentionOps | None = None
        self.kv_rotation: torch.Tensor | None = None  # set by bind for an int8 cache
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def bind(
        self, cache: LayerCache, ops: AttentionOps, kv_rotation: torch.Tensor | None = None
    ) -> None:
        """This layer's K/V (and scales) in the runner's cache, the ops that use them, and
        for an int8 cache the matrix its rows are rotated by, in the model dtype
        (``llmctl.engine.quant.kv_rotation``)."""
        self.cache, self.ops, self.kv_rotation = cache, ops, kv_rotation

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, -1, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Queries and keys rotate together: one set of elementwise ops for both.
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache, kv_scales = self.cache
        ops = self.ops
        rotation = self.kv_rotation
        if rotation is not None:  # an int8 cache holds rotated rows (quant.kv_rotation)
            q, k, v = q @ rotation, k @ rotation, v @ rotation
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales=kv_scales)
        if meta.is_decode:
            out = ops.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                kv_scales=kv_scales,
            )
        else:
            out = ops.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.context_lens,
                self.scale,
                kv_scales=kv_scales,
            )
        if rotation is not None:  # H H = I
            out = out @ rotation
        return self.o_proj(out.reshape(num_tokens, self.q_size))


# On the CPU a long prompt's MLP runs this many rows at a time. Its three [tokens,
# intermediate]-sized activations are the step's largest: whole, at 8,192 tokens of a
# 512-wide model, each is 46-92 MB, and glibc maps every buffer above 32 MiB afresh, so
# each of their pages faults on first touch; a chunk's stay in the cache. That MLP took
# 187 ms a layer whole and 134 ms in chunks of 1,024 rows, a product that size still
# runs at full speed (docs/benchmarks.md).
CPU_MLP_ROWS = 1024


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = CPU_MLP_ROWS
        lora = self.gate_up_proj.lora
        # An adapter's rows are grouped over the whole step (LoraContext): not chunked.
        if (
            x.device.type != "cpu"
            or x.shape[0] <= rows
            or (lora is not None and lora.context.active)
        ):
            return self.swiglu(x)
        out = x.new_empty(x.shape[0], self.down_proj.out_features)
        for start in range(0, x.shape[0], rows):
            out[start : start + rows] = self.swiglu(x[start : start + rows])
        return out

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3: they differ only in config (biases, q/k norms,
    tying, RoPE, GQA)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.rotary = RotaryEmbedding(config)
        # Tied models reuse the embedding matrix as the output projection.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 logits ``[len(logits_indices), vocab]`` for the chosen rows of the batch
        (each attention layer reads and writes its own slice of the cache)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta)
        return self.compute_logits(self.model.norm(x[logits_indices]))

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final hidden states ``x``."""
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return dense_linear(x, head).float()


def to_model_state(
    weights: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Map HF Llama-family tensor names onto this model's (merging q/k/v and gate/up).

    Consumes ``weights``. A missing or unexpected tensor is a ModelError naming it.
    """
    state: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for merged, parts in MERGED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{part}.{kind}" for part in parts]
                missing = [name for name in names if name not in weights]
                if missing and len(missing) < len(names):
                    raise ModelError(f"checkpoint is missing {', '.join(missing)}")
                if not missing:
                    state[f"{prefix}{merged}.{kind}"] = torch.cat([weights.pop(n) for n in names])
    for name, tensor in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints saved this buffer; it is recomputed
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints store a copy of the embeddings
        state[name] = tensor
    return state


def build_model(
    weights: dict[str, torch.Tensor],
    config: ModelConfig,
    device: torch.device | str,
    new_model: Callable[[ModelConfig], LlamaForCausalLM] = LlamaForCausalLM,
) -> LlamaForCausalLM:
    """The model with ``weights`` (HF names, already in the target dtype) as its parameters,
    without allocating or initialising any other copy of them. ``new_model`` makes the
    module (a tensor-parallel rank passes its sharded variant)."""
    state = to_model_state(weights, config)
    with torch.device("meta"):
        model = new_model(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        details = [f"missing {_first_few(missing)}"] if missing else []
        details += [f"unexpected {_first_few(unexpected)}"] if unexpected else []
        raise ModelError(
            f"the checkpoint does not fit a {config.architecture} with this config.json: "
            + "; ".join(details)
        )
    wrong_shapes = [
        f"{name} {tuple(state[name].shape)} (expected {tuple(param.shape)})"
        for name, param in expected.items()
        if state[name].shape != param.shape
    ]
    if wrong_shapes:
        raise ModelError(
            "checkpoint tensor shapes do not match config.json: " + "; ".join(wrong_shapes[:5])
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).requires_grad_(False).eval()


def _first_few(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (
        f" and {len(names) - limit} more" if len(names) > limit else ""
    )


class TorchModelRunner(PagedRunner):
    """Runs a Llama-family model over a paged KV cache of ``num_blocks`` blocks.

    ``num_blocks`` may be left out and given later through ``allocate_kv_cache`` (the
    engine sizes the cache from the memory free once the weights are loaded).
    ``max_num_seqs`` and ``max_model_len`` (default: the model's context) bound the
    decode steps the CUDA graphs are captured for; ``cuda_graphs=False`` turns them off.
    ``quantization`` (``none`` or ``int8``) converts the linear layers' weights once
    loaded; ``kv_cache_dtype`` (``auto``, ``int8``, ``fp8``) is the cache's element type.
    ``max_loras`` LoRA slots of rank ``max_lora_rank`` serve adapters (``LoraRunner``).
    """

    serves_lora = True  # a tensor-parallel runner does not (yet)

    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        *,
        num_blocks: int | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        quantization: str = "none",
        **paged: Any,
    ) -> None:
        super().__init__(config, **paged)  # PagedRunner's options: dtype, device, block size...
        self.ops = attention_ops(self.device, self.kv_dtype)
        self.model = self._load_model(model_dir)
        # On the CPU turbo's product kernel where its ops serve attention (NativeMethod).
        native = self.ops.name == "native" and self.dtype in NATIVE_DTYPES
        quantize_linears(self.model, quantization, native)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.loras: ModelLoras | None = None  # made when the first adapter is loaded
        self.kv_caches: list[LayerCache] = []
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    def _load_model(self, model_dir: str | Path) -> LlamaForCausalLM:
        """The model with its weights on ``self.device`` (a tensor-parallel rank overrides
        this to load its shard)."""
        weights = load_weights(model_dir, self.dtype, self.device)
        return build_model(weights, self.config, self.device)

    def read_lora(self, spec: AdapterSpec) -> LoraWeights:
        return read_lora_weights(spec, self.dtype, pin=self.device.type == "cuda")

    def allocate_lora_slots(self) -> None:
        if self.loras is None:
            # On the CPU turbo's LoRA kernel where its ops serve attention too.
            native = self.ops.name == "native"
            kernel = "triton" if self.device.type == "cuda" else "native" if native else "torch"
            self.loras = ModelLoras(
                self.model, self.max_loras, self.max_lora_rank, self.dtype, kernel
            )

    def load_lora_slot(self, slot: int, weights: LoraWeights) -> None:
        self.allocate_lora_slots()
        self.loras.load_slot(slot, weights)

    def eager_step(self, batch: StepBatch) -> torch.Tensor:
        with self._step_threads(len(batch.input_ids)):
            if batch.lora_slots is None:
                return super().eager_step(batch)
            context = self.loras.context
            context.prepare(batch.lora_slots, batch.query_lens)  # grouped by slot on the host
            try:
                return super().eager_step(batch)
            finally:
                context.clear()

    @contextmanager
    def _step_threads(self, tokens: int) -> Iterator[None]:
        """A small CPU step on one torch thread but for its large products
        (``cpu_threads``); the count before it is set back after, for whatever else runs
        torch here."""
        small = tokens * self.config.hidden_size < ONE_THREAD_STEP_ELEMENTS
        if self.device.type != "cpu" or not small:
            yield
            return
        self.ops.start_threads()  # at the full count, not the step's one
        with one_thread_step(torch.get_num_threads()):
            yield

    def graphs_take_lora(self) -> bool:
        # The layers read a graph's per-token slots on the device (LoraContext.use_slots).
        return self.loras is not None

    def _allocate(self, num_blocks: int) -> None:
        """One ``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` tensor, viewed
        as a (K, V) pair per layer and handed to that layer's attention (``bind``); an
        int8 / fp8 cache has a float32 scale per token and KV head beside it, ``[2,
        layers, num_blocks, block_size, kv_heads]``. Zeroed, not
        empty: attention masks unwritten slots with a zero weight, and 0 * NaN from
        uninitialised memory would still be NaN. On the CPU its memory is taken as blocks
        are first used (``new_cache``)."""
        c = self.config
        shape = (2, c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        cache = self.new_cache(shape, self.kv_dtype)
        scales = None
        if is_quantized_kv(self.kv_dtype):
            scales = self.new_cache(shape[:-1], SCALE_DTYPE)
        self.kv_caches = [
            LayerCache(
                cache[0, layer],
                cache[1, layer],
                None if scales is None else (scales[0, layer], scales[1, layer]),
            )
            for layer in range(c.num_layers)
        ]
        # One rotation matrix for every layer, built once (an int8 cache's rows are rotated).
        rotation = (
            kv_rotation(c.head_dim, self.dtype, self.device)
            if self.kv_dtype == torch.int8
            else None
        )
        for layer, layer_cache in zip(self.model.model.layers, self.kv_caches):
            layer.self_attn.bind(layer_cache, self.ops, rotation)

    def weight_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def captures_graphs(self) -> bool:
        # The plain-torch kernels (LLMCTL_TORCH_ATTENTION=torch, for debugging) cannot
        # skip the padding rows a graph bucket adds: they decode eagerly.
        return self.cuda_graphs and self.ops.name == "triton"

    def forward(self, inputs: StepInputs, is_decode: bool) -> torch.Tensor:
        if inputs.lora_slots is None:
            return self._forward(inputs, is_decode)
        context = self.loras.context  # a graph's inputs: the slots of its tokens
        context.use_slots(inputs.lora_slots)
        try:
            return self._forward(inputs, is_decode)
        finally:
            context.clear()

    def _forward(self, inputs: StepInputs, is_decode: bool) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping.long(),  # index_copy_ (plain torch) wants int64
            block_tables=inputs.block_tables,
            context_lens=inputs.context_lens,
            query_start_loc=inputs.query_start_loc,
            is_decode=is_decode,
        )
        return self.model(
            inputs.input_ids,
            inputs.positions,
            meta,
            inputs.logits_rows(),  # each sequence's last token, or a speculative step's
        )
