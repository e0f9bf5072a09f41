"""turbo's option and model rules. Light on purpose: no torch import.

turbo has no settings of its own beyond the shared ``llmctl.engine.config.EngineConfig``
(no native code reads any other name), so its config is that one, with no extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmctl.backend import (
    CUDA_GRAPHS_RULE,
    DEVICE_RULE,
    SPECULATIVE_RULES,
    Hardware,
    ModelRule,
    OptionRule,
    one_device_rules,
)
from llmctl.model.config import ModelConfig
from llmctl.model.lora import adapters_problem

LLAMA_FAMILY = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
# The largest head turbo's CUDA attention kernels take (TURBO_CUDA_MAX_HEAD_DIM).
CUDA_MAX_HEAD_DIM = 256


def block_size_problem(block_size: int, on_cuda: bool, hardware: Hardware) -> str | None:
    """Why turbo's kernels cannot use ``block_size`` here (``None``: they can)."""
    if not on_cuda:
        multiple, why = 16, "turbo's CPU kernels need a multiple of 16"
    else:
        major, minor = hardware.compute_capability or (0, 0)
        multiple = 32 if major >= 8 else 64
        why = (
            f"turbo's CUDA kernels need a multiple of {multiple} on compute capability "
            f"{major}.{minor}" + ("" if major >= 8 else " (< 8.0)")
        )
    return why if block_size % multiple else None


def int8_weights_problem(device: str, dtype: str) -> str | None:
    """Why turbo cannot run int8 weights on ``device`` in ``dtype`` (``None``: it can).
    Its CUDA kernel takes every model dtype; its CPU ones float32 or bfloat16."""
    if device != "cuda" and dtype == "float16":
        return (
            "turbo's int8 weights run on its CPU kernels in float32 or bfloat16, not "
            "float16; use --dtype float32 or bfloat16"
        )
    return None


def gguf_blocks_problem(device: str, dtype: str) -> str | None:
    """Why turbo cannot run a GGUF file's blocks on ``device`` in ``dtype`` (``None``: it
    can). Its CUDA kernel takes every model dtype; its CPU ones float32 or bfloat16."""
    if device != "cuda" and dtype == "float16":
        return (
            "turbo's GGUF block kernels take float32 or bfloat16 activations, not float16; "
            "use --dtype float32 or bfloat16"
        )
    return None


def weight_groups(
    quantization: str, group_size: int | None, zero_point: bool | None
) -> tuple[int, int, bool] | None:
    """``(bits, group size, zero point)`` of group-wise weights (int4, or int8 with a
    group size), run as GGUF blocks by the block kernels; ``None`` for none, per-channel
    int8 and gguf. int4's defaults: groups of 32 with a zero point (Q4_1). Rounded by
    GPTQ, it keeps more of stories260K's greedy and teacher-forced choices than symmetric
    groups (29 % and 92.0 % of 64-step runs against 14 % and 90.7 %), though these cost
    less perplexity on its fixed text (2.1 % against 4.5 %; docs/quantization.md)."""
    if quantization == "int4":
        return 4, group_size or 32, zero_point is not False
    if quantization == "int8" and group_size is not None:
        return 8, group_size, False
    return None


def weight_groups_problem(device: str, dtype: str) -> str | None:
    """Why turbo cannot run group-wise weights here (``None``: it can): they are GGUF
    blocks, so the block kernels' limits."""
    if device == "cuda":
        return (
            "turbo runs group-wise weights (int4, int8 with a group size) in its CPU block "
            "kernels only; on CUDA use quantization int8 without quantization_group_size "
            "(per output channel)"
        )
    return gguf_blocks_problem(device, dtype)


def quantization_problem(value: str, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """The quantization rule: int8, int4 and gguf each have their device and dtype limits,
    and gguf needs a GGUF file."""
    device = hardware.device_for(options.get("device", "auto"))
    dtype = options.get("dtype", "auto")
    if weight_groups(value, options.get("quantization_group_size"), None):
        return weight_groups_problem(device, dtype)
    if value == "int8":
        return int8_weights_problem(device, dtype)
    if value == "gguf":
        from llmctl.model.gguf import gguf_file  # numpy: not at import (llmctl --help)
        from llmctl.model.info import DEFAULT_MODEL

        model = options.get("model")
        # The default model's name stands for its GGUF file (SmolLM2's Q4_1).
        if model and model != DEFAULT_MODEL and gguf_file(model) is None:
            return (
                f"quantization=gguf runs the blocks of a GGUF file, and {model} is not one; "
                "use quantization none or int8 for a Hugging Face checkpoint"
            )
        return gguf_blocks_problem(device, dtype)
    return None


def group_size_problem(value: int, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """quantization_group_size means something for int4 and int8 only."""
    quantization = options.get("quantization", "none")
    if quantization not in ("int4", "int8"):
        return (
            f"quantization_group_size sets the groups of int4 or int8 weights, and "
            f"quantization is {quantization}: set quantization int4 or int8, or drop it"
        )
    return None


def zero_point_problem(value: bool, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """quantization_zero_point: int4 only (Q4_1); int8 groups are symmetric (Q8_0)."""
    quantization = options.get("quantization", "none")
    if value and quantization != "int4":
        return (
            f"quantization_zero_point makes int4 groups asymmetric (Q4_1), and quantization "
            f"is {quantization}: int8 groups are symmetric (Q8_0); set quantization int4 "
            "or drop it"
        )
    return None


def quantized_kv_problem(kv_cache_dtype: str) -> str | None:
    """Why turbo cannot keep a ``kv_cache_dtype`` cache (``None``: it can). An int8 cache is read by its CPU kernels and its CUDA SIMT attention kernel; fp8 by
    none of its kernels."""
    if kv_cache_dtype == "fp8":
        return (
            "turbo has no fp8 KV-cache kernels; the torch backend supports "
            "kv_cache_dtype=fp8 on CUDA GPUs of compute capability >= 8.9"
        )
    return None


RULES = (
    OptionRule(
        "cache_block_seq_len",
        "a multiple of 16 on CPU, of 32 on CUDA compute capability >= 8.0, else of 64",
        lambda value, options, hardware: block_size_problem(
            value, hardware.device_for(options.get("device", "auto")) == "cuda", hardware
        ),
    ),
    OptionRule(
        "lora",
        "PEFT LoRA adapters (q/k/v/o/gate/up/down) of the model's shapes, rank <= "
        "max_lora_rank, in turbo's native LoRA kernels on CPU and CUDA",
        # Its CPU step (csrc/cpu/lora_kernels.h) and its CUDA step (csrc/cuda/lora.cu)
        # apply adapters over every base weight format and dtype they run: only the
        # adapters themselves are checked.
        lambda value, options, hardware: adapters_problem(value, options),
    ),
    OptionRule(
        "cpu_threads",
        "sizes turbo's own thread pool (work-sharing, so a busy core does not stall a step) "
        "and torch's",
        lambda value, options, hardware: None,
    ),
    OptionRule(
        "quantization",
        "`int8` on CUDA (any dtype) and on CPU (turbo's CPU kernels, float32 or bfloat16 "
        "activations); `gguf` for a GGUF file: on CPU Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
        "Q5_K and Q6_K matrices run as their blocks (int8 activations per 32-block, AVX-512 "
        "VNNI where the CPU has it; float32 or bfloat16, not float16); on CUDA (any dtype) "
        "Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K run as the file's blocks in a decode GEMV "
        "(prompts: dequantized per layer for cuBLAS) and the embedding table is dequantized "
        "to `dtype`; other types are dequantized to `dtype`; `int4` and group-wise `int8` on "
        "CPU (float32 or bfloat16), quantized at load into those blocks",
        quantization_problem,
    ),
    OptionRule(
        "quantization_group_size",
        "32, 64 or 128 with int4 or int8 (CPU): the scale is shared by 1, 2 or 4 of the "
        "block kernels' 32-blocks, which hold a scale each, so memory is the same",
        group_size_problem,
    ),
    OptionRule("quantization_zero_point", "int4 only (Q4_1 blocks)", zero_point_problem),
    OptionRule(
        "kv_cache_dtype",
        "`int8` on CPU and CUDA (on CUDA the SIMT attention kernel reads it, slower than the "
        "vectorised float-cache kernels); no `fp8`",
        lambda value, options, hardware: quantized_kv_problem(value),
    ),
    DEVICE_RULE,
    CUDA_GRAPHS_RULE,
    *SPECULATIVE_RULES,
    *one_device_rules("turbo"),
)


def mlp_bias_problem(config: ModelConfig) -> str | None:
    """Why turbo cannot run this model's MLP (``None``: it can): its native step has no
    MLP biases (Llama's ``mlp_bias: true``)."""
    if config.mlp_bias:
        return "turbo does not support MLP biases (mlp_bias: true); use the torch backend"
    return None


def _cuda_head_dim_problem(
    config: ModelConfig, options: Mapping[str, Any], hardware: Hardware
) -> str | None:
    if hardware.device_for(options.get("device", "auto")) != "cuda":
        return None
    if config.head_dim > CUDA_MAX_HEAD_DIM:
        return (
            f"head_dim {config.head_dim} is larger than turbo's CUDA attention kernels take "
            f"({CUDA_MAX_HEAD_DIM}); use the torch backend"
        )
    return None


# What a model needs from turbo's kernels (Backend.check): q/k/v and o biases, tied
# embeddings, llama3 and linear RoPE all run; MLP biases do not.
MODEL_RULES = (
    ModelRule("mlp_bias", "not supported", lambda config, options, hw: mlp_bias_problem(config)),
    ModelRule("head_dim", f"at most {CUDA_MAX_HEAD_DIM} on CUDA", _cuda_head_dim_problem),
)
