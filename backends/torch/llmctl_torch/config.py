"""The torch backend's own part of the engine configuration, and its option and model rules.

``torch_config`` builds the shared ``EngineConfig`` with the torch backend's extra
(``TorchExtra``: the tensor-parallel layout). Light on purpose: no torch
import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.backend import (
    CUDA_GRAPHS_RULE,
    DEVICE_RULE,
    SPECULATIVE_RULES,
    TORCH_THREADS_RULE,
    ModelRule,
    OptionRule,
    fp8_problem,
)
from llmctl.engine.config import EngineConfig
from llmctl.errors import ModelError
from llmctl.hardware import Hardware
from llmctl.model.config import ModelConfig
from llmctl.model.info import resolve_model
from llmctl.model.lora import adapters_problem

# The largest head the Triton kernels tile (their head_dim tile is a power of two).
TRITON_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TorchExtra:
    """What only the torch backend has beside the shared ``EngineConfig``: the
    tensor-parallel layout (docs/multi-gpu.md)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TorchExtra:
        return cls(
            tensor_parallel_size=options["tensor_parallel_size"],
            nnodes=options["nnodes"],
            node_rank=options["node_rank"],
            master_addr=options["master_addr"],
            master_port=options["master_port"],
        )


# The torch engine's configuration: the shared one and the torch backend's extra.
TorchConfig = EngineConfig[TorchExtra]


def torch_config(options: Mapping[str, Any]) -> TorchConfig:
    """The one place the unified option names map to the torch engine's."""
    return EngineConfig.from_options(options, TorchExtra.from_options(options))


def block_size_problem(block_size: int) -> str | None:
    """Why the torch backend's kernels cannot use ``block_size`` (``None``: they can).
    Also checked by the Triton kernels themselves."""
    if block_size < 16 or block_size & (block_size - 1):
        return (
            "the torch backend needs a power of two of at least 16 (Triton tiles are "
            "powers of two): use 16, 32, 64, 128 or 256"
        )
    return None


def tensor_parallel_problem(
    tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int
) -> str | None:
    """Why a model with these sizes cannot be sharded over ``tp`` ranks (``None``: it can).

    Each rank takes ``num_heads / tp`` query heads and ``intermediate_size / tp`` MLP
    columns. KV heads are split the same way when there are at least ``tp`` of them;
    with fewer (one KV head, say) each is replicated on ``tp / num_kv_heads`` ranks, as
    vLLM does, so ``tp`` must then be a multiple of ``num_kv_heads``. Also checked by the
    runner when it shards the weights.
    """
    if tp == 1:
        return None

    def fits(n: int) -> bool:
        kv_ok = num_kv_heads % n == 0 if num_kv_heads >= n else n % num_kv_heads == 0
        return num_heads % n == 0 and intermediate_size % n == 0 and kv_ok

    if fits(tp):
        return None
    if num_heads % tp:
        why = f"it must divide the model's {num_heads} attention heads"
    elif intermediate_size % tp:
        why = f"it must divide the model's MLP size ({intermediate_size})"
    elif num_kv_heads >= tp:
        why = f"it must divide the model's {num_kv_heads} KV heads"
    else:
        why = (
            f"with fewer KV heads ({num_kv_heads}) than ranks, each KV head is replicated, "
            f"so it must be a multiple of {num_kv_heads}"
        )
    valid = [str(n) for n in range(1, num_heads + 1) if fits(n)]
    return f"tensor_parallel_size {tp} cannot shard this model: {why} (use {', '.join(valid)})"


def _model_tp_problem(tp: int, options: Mapping[str, Any]) -> str | None:
    if tp == 1:
        return None
    try:
        config = resolve_model(options.get("model") or "demo").config
    except ModelError:
        return None  # the model's own error is reported where it is loaded
    num_heads = config.get("num_attention_heads") or 1
    return tensor_parallel_problem(
        tp,
        num_heads,
        config.get("num_key_value_heads") or num_heads,
        config.get("intermediate_size") or 1,
    )


def _nodes_problem(nnodes: int, options: Mapping[str, Any]) -> str | None:
    tp = options.get("tensor_parallel_size", 1)
    if tp % nnodes:
        return (
            f"nnodes {nnodes} must divide tensor_parallel_size ({tp}): each machine runs "
            "tensor_parallel_size / nnodes ranks"
        )
    if nnodes > 1 and options.get("master_port") is None:
        return (
            f"nnodes {nnodes} needs master_port: the same free port of the head node, "
            "given on every machine"
        )
    return None


# Why torch refuses int4 rather than running a slow one: its weight methods are float and
# per-channel int8 (torch's own int8 kernel, a Triton GEMM); an int4 product dequantizing
# each group per call would save memory only, and be slower than the float weights on both
# devices. turbo's block kernels run int4 (CPU).
QUANTIZATION_REFUSALS = {
    "gguf": (
        "the torch backend has no kernels for GGUF blocks: with quantization none it "
        "dequantizes the file's blocks to its dtype at load; for the blocks themselves "
        "use --backend turbo (CPU)"
    ),
    "int4": (
        "the torch backend has no int4 kernel (a per-call dequantization would be slower "
        "than its float weights); use --backend turbo (CPU) for int4, or quantization int8"
    ),
}
GROUPS_REFUSAL = (
    "the torch backend quantizes int8 per output channel only; group-wise weights (int4, "
    "int8 with a group size) run on --backend turbo (CPU)"
)

RULES = (
    OptionRule(
        "cache_block_seq_len",
        "a power of two >= 16",
        lambda value, options, hardware: block_size_problem(value),
    ),
    TORCH_THREADS_RULE,
    OptionRule(
        "quantization",
        "`int8` on CPU (torch's int8 kernel) and CUDA (a Triton GEMM); no `gguf` (it has no "
        "block kernels: `none` dequantizes a GGUF file to `dtype`); no `int4`",
        lambda value, options, hardware: QUANTIZATION_REFUSALS.get(value),
    ),
    OptionRule(
        "quantization_group_size",
        "not supported (int8 is per output channel here)",
        lambda value, options, hardware: GROUPS_REFUSAL,
    ),
    OptionRule(
        "quantization_zero_point",
        "not supported (no int4)",
        lambda value, options, hardware: GROUPS_REFUSAL if value else None,
    ),
    OptionRule(
        "kv_cache_dtype",
        "`int8` everywhere; `fp8` on CUDA with compute capability >= 8.9",
        lambda value, options, hardware: fp8_problem(options, hardware) if value == "fp8" else None,
    ),
    DEVICE_RULE,
    CUDA_GRAPHS_RULE,
    *SPECULATIVE_RULES,
    OptionRule(
        "tensor_parallel_size",
        "must divide the attention heads and MLP size; KV heads divisible by it, or it a "
        "multiple of them (they are then replicated)",
        lambda value, options, hardware: _model_tp_problem(value, options),
        note=lambda value, options, hardware: (
            "decode runs eagerly with more than one rank: CUDA graphs are not captured over "
            "the ranks' collectives yet"
            if value > 1
            and options.get("cuda_graphs")
            and hardware.device_for(options.get("device", "auto")) == "cuda"
            else None
        ),
    ),
    OptionRule(
        "lora",
        "PEFT LoRA adapters (q/k/v/o/gate/up/down) of the model's shapes, rank <= "
        "max_lora_rank (sharded like the weights with tensor_parallel_size > 1)",
        lambda value, options, hardware: adapters_problem(value, options),
    ),
    OptionRule(
        "nnodes",
        "must divide tensor_parallel_size; more than 1 needs master_port",
        lambda value, options, hardware: _nodes_problem(value, options),
    ),
    OptionRule(
        "node_rank",
        "below nnodes",
        lambda value, options, hardware: (
            f"node_rank {value} must be below nnodes ({options.get('nnodes', 1)}): the "
            "machines are numbered 0 (the head node) to nnodes - 1"
            if value >= options.get("nnodes", 1)
            else None
        ),
    ),
)


def _triton_head_dim_problem(
    config: ModelConfig, options: Mapping[str, Any], hardware: Hardware
) -> str | None:
    if hardware.device_for(options.get("device", "auto")) != "cuda":
        return None  # the CPU kernels (C++ or plain torch) take any head size
    if config.head_dim > TRITON_MAX_HEAD_DIM:
        return (
            f"head_dim {config.head_dim} is larger than the torch backend's Triton kernels "
            f"take on CUDA ({TRITON_MAX_HEAD_DIM})"
        )
    return None


# What a model needs from the kernels (Backend.check). Everything ModelConfig accepts
# (q/k/v, o and MLP biases, q/k norms, tied embeddings, llama3 and linear RoPE) runs here.
MODEL_RULES = (
    ModelRule("head_dim", f"at most {TRITON_MAX_HEAD_DIM} on CUDA", _triton_head_dim_problem),
)
