"""The facts about a Llama-family model that the engines need, parsed from HF ``config.json``.

Shared by the torch and turbo backends. No torch import: the sizes here also feed
KV-cache budgeting before anything heavy loads.

Sliding-window attention (Mistral, Qwen2) is not implemented by the kernels. Inside
the window it is identical to full causal attention, so a model that declares a
window is served with its session length capped at that window: the default session
length is the window, and an explicit longer one is refused (``session_len``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import ModelError, OptionError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Bytes per element of the dtypes the engines run in, under every accepted spelling.
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear`` (factor) or ``llama3`` (all four fields)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before RoPE
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and eos ids from ``generation_config.json`` if present).

        The ``demo`` model's directory is generated on first use.
        """
        from llmctl.engine.demo import ensure_demo_materialized

        path = Path(path)
        ensure_demo_materialized(path)
        config = _read_json(path / "config.json", required=True)
        generation = _read_json(path / "generation_config.json", required=False)
        return cls.from_dict(config, generation)

    @classmethod
    def from_dict(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        architecture = (config.get("architectures") or ["<none>"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"architecture {architecture!r} is not supported; llmctl runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if not isinstance(config.get(key), int) or config[key] <= 0:
                raise ModelError(f"config.json: {key!r} must be a positive integer")
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ModelError(
                f"config.json: hidden_act {activation!r} is not supported (Llama-family "
                "models use 'silu')"
            )

        num_heads = config.get("num_attention_heads")
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ModelError("config.json: 'num_attention_heads' must be a positive integer")
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ModelError(
                f"config.json: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelError("config.json: partial_rotary_factor other than 1.0 is not supported")

        rope_theta, rope_scaling = _parse_rope(config)
        # Qwen2 always has q/k/v biases; Llama and Mistral have them only if asked.
        qkv_bias = architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias"))

        sliding_window = config.get("sliding_window")
        if config.get("use_sliding_window") is False:
            sliding_window = None

        eos = _as_id_tuple(config.get("eos_token_id"))
        if generation_config:
            eos += tuple(
                i for i in _as_id_tuple(generation_config.get("eos_token_id")) if i not in eos
            )

        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            mlp_bias=bool(config.get("mlp_bias", False)),
            # transformers' default for the Llama family is untied unless the config says so.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            sliding_window=int(sliding_window) if sliding_window else None,
            torch_dtype=_config_dtype(config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def session_len(self, requested: int | None = None) -> int:
        """The longest context (prompt + output) a sequence may reach.

        Default: ``max_position_embeddings``, capped at the sliding window if the model
        has one (the kernels do full attention, which equals windowed attention only
        inside the window). An explicit value beyond either limit is refused.
        """
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        if requested is None:
            return limit
        if requested <= 0:
            raise OptionError(f"session_len must be a positive integer, got {requested}")
        if self.sliding_window is not None and requested > self.sliding_window:
            raise OptionError(
                f"session_len {requested} exceeds this model's sliding window "
                f"({self.sliding_window} tokens); llmctl serves sliding-window models only "
                f"within the window: use session_len <= {self.sliding_window}"
            )
        if requested > self.max_position_embeddings:
            raise OptionError(
                f"session_len {requested} exceeds the model's max_position_embeddings "
                f"({self.max_position_embeddings}); use session_len <= "
                f"{self.max_position_embeddings}"
            )
        return requested

    def kv_bytes_per_block(self, block_size: int, dtype: Any) -> int:
        """Bytes one KV block takes across all layers: K and V, ``block_size`` tokens each.

        ``dtype`` is a dtype name (``"bfloat16"``, ``"fp16"``...) or a ``torch.dtype``.
        """
        itemsize = DTYPE_SIZES[canonical_dtype(dtype)] if isinstance(dtype, str) else dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * block_size * itemsize

    def resolve_dtype(self, requested: str) -> str:
        """``auto`` means the checkpoint's own dtype; anything else must be a known dtype."""
        return self.torch_dtype if requested == "auto" else canonical_dtype(requested)


def canonical_dtype(name: str) -> str:
    """``"bf16"`` → ``"bfloat16"`` etc.; an unknown name is an OptionError listing the choices."""
    canonical = _DTYPE_ALIASES.get(str(name).lower().removeprefix("torch."))
    if canonical is None:
        raise OptionError(
            f"dtype {name!r} is not supported: use auto, float32, bfloat16 or float16"
        )
    return canonical


def _parse_rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from the old (``rope_scaling``) or transformers-5
    (``rope_parameters``) layout; transformers 5 writes both, with the same content."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ModelError("config.json: per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(_rope_field(params, "factor")))
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings") or config.get(
            "max_position_embeddings"
        )
        return theta, RopeScaling(
            "llama3",
            factor=float(_rope_field(params, "factor")),
            low_freq_factor=float(_rope_field(params, "low_freq_factor")),
            high_freq_factor=float(_rope_field(params, "high_freq_factor")),
            original_max_position_embeddings=int(original),
        )
    raise ModelError(
        f"config.json: rope scaling type {rope_type!r} is not supported; llmctl supports "
        "no scaling, 'linear' and 'llama3'"
    )


def _rope_field(params: dict[str, Any], key: str) -> Any:
    if params.get(key) is None:
        raise ModelError(f"config.json: rope scaling {params.get('rope_type')!r} needs {key!r}")
    return params[key]


def _config_dtype(config: dict[str, Any]) -> str:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    try:
        return canonical_dtype(name)
    except OptionError:
        raise ModelError(f"config.json: dtype {name!r} is not supported") from None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelError(
                f"{path.parent} has no {path.name}: give a Hugging Face model directory "
                "(config.json + *.safetensors + tokenizer files)"
            )
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from None
