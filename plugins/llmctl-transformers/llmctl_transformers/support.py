"""Which models transformers' continuous-batching engine can run, asked without loading
any weights. Importing transformers imports torch (seconds), so this module is imported
only by checks, never when llmctl starts."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def causal_lm_architectures() -> frozenset[str]:
    """The causal-LM classes (``architectures[0]`` values) the installed transformers has."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def architecture_problem(config: dict[str, Any]) -> str | None:
    """Why transformers cannot generate with the model ``config`` (its config.json)
    describes through continuous batching, or None when it can."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("auto_map"):
        return (
            "the model ships its own modelling code (auto_map in config.json); llmctl never "
            "runs code from a model directory: use a model transformers implements"
        )
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        return (
            f"transformers {transformers.__version__} does not know model_type {model_type!r} "
            "(a newer transformers may)"
        )
    causal_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    architecture = (config.get("architectures") or [causal_class])[0]
    if architecture not in causal_lm_architectures():
        hint = f"; its causal-LM class would be {causal_class}" if causal_class else ""
        return (
            f"architecture {architecture} is not a causal language model transformers can "
            f"generate text with{hint}"
        )
    model_class = getattr(transformers, architecture, None)
    if model_class is None or not model_class.is_backend_compatible():
        return (
            f"transformers' {architecture} does not use the attention interface its "
            "continuous-batching engine plugs its paged KV cache into"
        )
    return None


def gguf_problem(model_path: Any, config: dict[str, Any]) -> str | None:
    """Why transformers' own GGUF loading (``gguf_file=``) cannot load this GGUF file
    faithfully, or None when it can (also None for a model that is no GGUF file)."""
    import importlib.util

    import transformers

    from llmctl.model.gguf import gguf_file

    if gguf_file(model_path) is None:
        return None
    if importlib.util.find_spec("gguf") is None:
        return "transformers reads GGUF files through the gguf package: pip install gguf"
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = config.get("model_type")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        return (
            f"transformers {transformers.__version__} cannot load GGUF files of architecture "
            f"{arch!r}; use the torch or turbo backend"
        )
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    reads_head_dim = "head_dim" in GGUF_CONFIG_MAPPING.get(arch, {}).values()
    if head_dim and heads and hidden and head_dim != hidden // heads and not reads_head_dim:
        return (
            f"transformers {transformers.__version__}'s GGUF loader does not read the head "
            f"size of {arch} files ({arch}.attention.key_length {head_dim}, not hidden_size / "
            f"heads = {hidden // heads}), so it cannot build this model; use the torch or "
            "turbo backend"
        )
    if config.get("rope_scaling"):
        # Its loader rebuilds rope scaling from the metadata only for gpt-oss.
        return (
            f"transformers {transformers.__version__}'s GGUF loader drops the file's rope "
            "scaling (rope.scaling.type), so its answers would be wrong; use the torch or "
            "turbo backend"
        )
    return None
