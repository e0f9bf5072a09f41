"""The Llama family sharded over ``tp`` ranks (tensor parallelism, as Megatron-LM and vLLM).

Each rank holds a slice of every large weight and runs the whole forward on it:

- column-parallel q/k/v and gate/up: the rank's query heads, KV heads and slice of the
  MLP. Their outputs stay split: attention runs over the rank's own heads (and its own
  KV cache), SwiGLU over its own columns;
- row-parallel o and down: the matching input columns. Each rank's product is a partial
  sum; an all-reduce makes the full result on every rank (a bias is added once, after);
- vocabulary-parallel embedding and LM head: ``ceil(vocab / tp)`` rows each, the last
  rank's padded with zeros. A token's embedding row lives on one rank, the others
  contribute zeros to an all-reduce; the logits of each rank's rows are gathered on
  rank 0, which samples.

KV heads are split like query heads when there are at least ``tp`` of them. With fewer
(one KV head, say), each rank holds the one KV head its query heads read, replicated on
``tp / num_kv_heads`` ranks, as vLLM does. Norms and RoPE are computed in full on every
rank. ``slice_of`` says which part of each checkpoint tensor a rank reads, so a rank
loads only its shard from the safetensors files.

LoRA adapters are sharded the same way (``lora_shard``): a column-parallel layer's
adapter keeps ``A`` whole and the rank's rows of ``B``; a row-parallel one the rank's
columns of ``A`` and ``B`` whole, its partial product summed with the base one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmctl.errors import ModelError, OptionError
from llmctl.model.config import ModelConfig
from llmctl.model.weights import SliceOf, load_weight_slices
from llmctl_torch.config import tensor_parallel_problem
from llmctl_torch.linear import Linear
from llmctl_torch.lora import LoraWeights
from llmctl_torch.model import LlamaForCausalLM, build_model


@dataclass(frozen=True)
class Shard:
    """Which of ``size`` ranks this is, and the process group its collectives use."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The sizes one rank's layers have: its heads, its KV heads, its MLP slice. A model
    that cannot be split so is the option rule's error (the same check)."""
    problem = tensor_parallel_problem(
        tp, config.num_heads, config.num_kv_heads, config.intermediate_size
    )
    if problem:
        raise OptionError(problem)
    return replace(
        config,
        num_heads=config.num_heads // tp,
        num_kv_heads=max(1, config.num_kv_heads // tp),
        intermediate_size=config.intermediate_size // tp,
    )


def vocab_rows(vocab_size: int, tp: int) -> int:
    """Embedding and LM-head rows per rank (the last rank's real rows may be fewer)."""
    return -(-vocab_size // tp)


def slice_of(config: ModelConfig, rank: int, tp: int) -> SliceOf:
    """For ``load_weight_slices``: the ``(dim, start, stop)`` of each HF tensor that
    ``rank`` holds, or None for a tensor every rank holds whole (norms, o/down biases)."""
    d, heads, mlp = config.head_dim, config.num_heads // tp, config.intermediate_size // tp
    if config.num_kv_heads >= tp:
        kv_heads = config.num_kv_heads // tp
        first_kv = rank * kv_heads
    else:  # replicated: the one KV head this rank's query heads read
        kv_heads, first_kv = 1, rank * config.num_kv_heads // tp
    rows = vocab_rows(config.vocab_size, tp)
    q_total, kv_total = config.num_heads * d, config.num_kv_heads * d
    q = (rank * heads * d, (rank + 1) * heads * d)
    kv = (first_kv * d, (first_kv + kv_heads) * d)
    columns = (rank * mlp, (rank + 1) * mlp)
    vocab = (rank * rows, min((rank + 1) * rows, config.vocab_size))
    # A module's name: its weight and bias; a parameter's name: that one only.
    # -> (dimension split, full size along it, this rank's [start, stop))
    parts = {
        "self_attn.q_proj": (0, q_total, q),
        "self_attn.k_proj": (0, kv_total, kv),
        "self_attn.v_proj": (0, kv_total, kv),
        "mlp.gate_proj": (0, config.intermediate_size, columns),
        "mlp.up_proj": (0, config.intermediate_size, columns),
        "self_attn.o_proj.weight": (1, q_total, q),
        "mlp.down_proj.weight": (1, config.intermediate_size, columns),
        "model.embed_tokens.weight": (0, config.vocab_size, vocab),
        "lm_head.weight": (0, config.vocab_size, vocab),
    }

    def where(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        local = name.split(".", 3)[3] if name.startswith("model.layers.") else name
        part = parts.get(local) or parts.get(local.rpartition(".")[0])
        if part is None:
            return None
        dim, total, (start, stop) = part
        if len(shape) <= dim or shape[dim] != total:
            raise ModelError(
                f"checkpoint tensor {name} {list(shape)} does not match config.json "
                f"(expected {total} along dimension {dim})"
            )
        return dim, start, stop

    return where


def lora_shard(weights: LoraWeights, config: ModelConfig, rank: int, tp: int) -> LoraWeights:
    """This rank's part of an adapter: each module's ``(A [r, in], B [out, r])`` cut where
    ``slice_of`` cuts the module's weight ``[out, in]`` (B's rows: the output; A's
    columns: the input); a module every rank holds whole keeps both."""
    where = slice_of(config, rank, tp)
    shard: LoraWeights = {}
    for module, (a, b) in weights.items():
        part = where(f"{module}.weight", (b.shape[0], a.shape[1]))
        if part is not None:
            dim, start, stop = part
            if dim == 0:
                b = b[start:stop]
            else:
                a = a[:, start:stop]
        shard[module] = (a.contiguous(), b.contiguous())
    return shard


class RowParallelLinear(Linear):
    """A linear layer over this rank's slice of the input features: the ranks' partial
    products (in the layer's weight format, see ``linear.py``) are summed (all-reduce);
    the bias, whole on every rank, is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, None)
        lora = self.lora
        if lora is not None and lora.context.active:
            # This rank's A columns: B @ (A_rank @ x_rank) is the adapter's partial sum,
            # completed by the same all-reduce as the base product.
            lora.apply(x, out)
        dist.all_reduce(out, group=self.shard.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table. Tokens whose row is elsewhere embed as
    zeros; the all-reduce leaves each token its one real row."""

    def __init__(self, rows: int, dim: int, shard: Shard) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.first_row = shard.rank * rows
        self.shard = shard

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local_ids = token_ids - self.first_row
        elsewhere = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        out = out.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=self.shard.group)
        return out


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard: ``LlamaForCausalLM`` with the rank's sizes and the layers above.
    Rank 0's forward returns the logits of the whole vocabulary, the others' ``None``."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__(local_config(config, shard.size))
        self.shard = shard
        self.vocab_size = config.vocab_size
        hidden, rows = config.hidden_size, vocab_rows(config.vocab_size, shard.size)
        self.model.embed_tokens = VocabParallelEmbedding(rows, hidden, shard)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(hidden, rows, bias=False)
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.o_proj = RowParallelLinear(
                attention.q_size, hidden, config.o_proj_bias, shard
            )
            mlp.down_proj = RowParallelLinear(mlp.intermediate_size, hidden, config.mlp_bias, shard)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each rank's logits for its vocabulary rows, gathered on rank 0 (before sampling)."""
        local = super().compute_logits(x).contiguous()
        rank, size, group = self.shard.rank, self.shard.size, self.shard.group
        parts = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
        dist.gather(local, parts, dst=0, group=group)
        return None if parts is None else torch.cat(parts, dim=-1)[:, : self.vocab_size]


def load_shard(
    model_dir: str,
    config: ModelConfig,
    shard: Shard,
    dtype: torch.dtype,
    device: torch.device,
) -> ParallelLlamaForCausalLM:
    """Read this rank's slices of the checkpoint (only those bytes) into its shard."""
    weights = load_weight_slices(model_dir, slice_of(config, shard.rank, shard.size), dtype, device)
    rows = vocab_rows(config.vocab_size, shard.size)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:  # the last rank's rows, padded with zeros to the common count
            weights[name] = F.pad(weights[name], (0, 0, 0, rows - weights[name].shape[0]))
    return build_model(
        weights, config, device, new_model=lambda full: ParallelLlamaForCausalLM(full, shard)
    )
