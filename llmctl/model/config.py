"""The facts about a Llama-family model that the engines need, parsed from HF ``config.json``.

Shared by the torch and turbo backends. No torch import: the sizes here also feed
KV-cache budgeting before anything heavy loads.

Sliding-window attention (Mistral, Qwen2) is not implemented by the kernels. Inside
the window it is identical to full causal attention, so a model that declares a
window is served with its session length capped at that window: the default session
length is the window, and an explicit longer one is refused (``session_len``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import ModelError, OptionError
from llmctl.model.files import describe, read_architecture, read_json_object

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
# A quantized KV cache (kv_cache_dtype int8 / fp8): one byte per element, plus one
# float32 scale per token and KV head (llmctl.engine.quant).
KV_QUANTIZED_ELEMENT_BYTES = {"int8": 1, "fp8": 1}
KV_SCALE_BYTES = 4
# The default of a ConfigReader key that must be present.
REQUIRED: Any = object()


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
    o_proj_bias: bool
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
        """Read ``config.json`` (and eos ids from ``generation_config.json`` if present),
        or the metadata of a GGUF file (``path`` is the file or a directory holding it).

        The ``demo`` model's directory is generated on first use.
        """
        from llmctl.model.demo import ensure_demo_materialized
        from llmctl.model.gguf import gguf_file, open_gguf

        if (gguf := gguf_file(path)) is not None:
            return cls.from_dict(open_gguf(gguf).hf_config, source=f"{gguf} (GGUF metadata)")
        path = Path(path)
        ensure_demo_materialized(path)
        config = read_json_object(path / "config.json", required=True)
        generation = read_json_object(path / "generation_config.json", required=False)
        return cls.from_dict(
            config,
            generation,
            source=str(path / "config.json"),
            generation_source=str(path / "generation_config.json"),
        )

    @classmethod
    def from_dict(
        cls,
        config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        *,
        source: str = "config.json",
        generation_source: str = "generation_config.json",
    ) -> ModelConfig:
        """Parse a config.json object; a value of the wrong type or out of range is a
        ModelError naming ``source`` and the key."""
        read = ConfigReader(config, source)
        architecture = read_architecture(config, source)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"architecture {architecture!r} is not supported; llmctl runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if "quantization_config" in config:
            method = config["quantization_config"]
            method = method.get("quant_method", "?") if isinstance(method, dict) else method
            raise ModelError(
                f"{source}: quantized checkpoints ({method}) are not supported; use the "
                "model's unquantized (float16/bfloat16/float32) weights"
            )
        hidden_size = read.integer("hidden_size")
        activation = read.string("hidden_act", "silu")
        if activation != "silu":
            raise ModelError(
                f"{source}: hidden_act {activation!r} is not supported (Llama-family "
                "models use 'silu')"
            )
        num_heads = read.integer("num_attention_heads")
        num_kv_heads = read.integer("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ModelError(
                f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if config.get("head_dim") is None and hidden_size % num_heads:
            raise ModelError(
                f"{source}: hidden_size ({hidden_size}) is not divisible by "
                f"num_attention_heads ({num_heads}), and there is no head_dim to say the "
                "size of a head: fix one of them"
            )
        head_dim = read.integer("head_dim", hidden_size // num_heads)
        if head_dim % 2:
            raise ModelError(
                f"{source}: the head size ({head_dim}) must be even: rotary embeddings "
                "rotate pairs of values"
            )
        if read.number("partial_rotary_factor", 1.0) != 1.0:
            raise ModelError(f"{source}: partial_rotary_factor other than 1.0 is not supported")

        rope_theta, rope_scaling = _parse_rope(read)
        # Which biases each architecture has, as transformers builds it: Llama and Qwen3
        # follow attention_bias (q/k/v and o), Qwen2 always has q/k/v biases, Mistral none;
        # only Llama has mlp_bias.
        attention_bias = read.boolean("attention_bias", False)
        qkv_bias = architecture == "Qwen2ForCausalLM" or (
            attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        )
        o_proj_bias = attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        mlp_bias = architecture == "LlamaForCausalLM" and read.boolean("mlp_bias", False)

        sliding_window = read.integer("sliding_window", 0, minimum=0) or None
        if not read.boolean("use_sliding_window", True):
            sliding_window = None

        vocab_size = read.integer("vocab_size")
        eos = token_ids(config.get("eos_token_id"), source, "eos_token_id", vocab_size)
        if generation_config:
            more = token_ids(
                generation_config.get("eos_token_id"), generation_source, "eos_token_id", vocab_size
            )
            eos += tuple(i for i in more if i not in eos)
        bos = read.integer("bos_token_id", None, minimum=0)
        if bos is not None and bos >= vocab_size:
            raise ModelError(
                f"{source}: bos_token_id {bos} is outside the vocabulary (vocab_size {vocab_size})"
            )

        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=read.integer("intermediate_size"),
            num_layers=read.integer("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=read.number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            mlp_bias=mlp_bias,
            # transformers' default for the Llama family is untied unless the config says so.
            tie_word_embeddings=read.boolean("tie_word_embeddings", False),
            max_position_embeddings=read.integer("max_position_embeddings", 2048),
            sliding_window=sliding_window,
            torch_dtype=_config_dtype(read),
            bos_token_id=bos,
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

    def kv_bytes_per_block(self, block_size: int, dtype: Any, kv_cache_dtype: str = "auto") -> int:
        """Bytes one KV block takes across all layers: K and V, ``block_size`` tokens each.

        ``dtype`` is the model's dtype: a name (``"bfloat16"``, ``"fp16"``...) or a
        ``torch.dtype``; the cache holds it when ``kv_cache_dtype`` is ``auto``. An
        ``int8`` / ``fp8`` cache holds one byte per element and a scale per token and KV
        head (head_dim + 4 bytes per row: 4 * head_dim / (head_dim + 4) times fewer
        than fp32, 3.8x at head_dim 64).
        """
        if kv_cache_dtype in KV_QUANTIZED_ELEMENT_BYTES:
            row_bytes = self.head_dim * KV_QUANTIZED_ELEMENT_BYTES[kv_cache_dtype] + KV_SCALE_BYTES
        else:
            itemsize = (
                DTYPE_SIZES[canonical_dtype(dtype)] if isinstance(dtype, str) else dtype.itemsize
            )
            row_bytes = self.head_dim * itemsize
        return 2 * self.num_layers * self.num_kv_heads * block_size * row_bytes

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


def _parse_rope(read: ConfigReader) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from the old (``rope_scaling``) or transformers-5
    (``rope_parameters``) layout; transformers 5 writes both, with the same content."""
    key = "rope_parameters" if read.config.get("rope_parameters") else "rope_scaling"
    params = read.config.get(key) or {}
    if not isinstance(params, dict):
        raise ModelError(f"{read.source}: {key!r} must be an object, got {describe(params)}")
    if any(isinstance(value, dict) for value in params.values()):
        raise ModelError(f"{read.source}: per-layer-type rope_parameters are not supported")
    rope = ConfigReader(params, read.source, prefix=f"{key}.")
    theta = read.number("rope_theta", 10000.0)
    if params.get("rope_theta") is not None:
        # transformers 5 writes theta twice; the engines use the nested one, so an edit of
        # only the top-level one would be silently ignored
        nested = rope.number("rope_theta")
        if read.config.get("rope_theta") is not None and nested != theta:
            raise ModelError(
                f"{read.source}: rope_theta ({theta:g}) and {key}.rope_theta ({nested:g}) "
                "disagree; make them equal"
            )
        theta = nested
    rope_type = rope.string("rope_type", None) or rope.string("type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ModelError(
            f"{read.source}: rope scaling type {rope_type!r} is not supported; llmctl supports "
            "no scaling, 'linear' and 'llama3'"
        )
    factor = _rope_number(rope, rope_type, "factor")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=factor)
    return theta, RopeScaling(
        "llama3",
        factor=factor,
        low_freq_factor=_rope_number(rope, rope_type, "low_freq_factor"),
        high_freq_factor=_rope_number(rope, rope_type, "high_freq_factor"),
        original_max_position_embeddings=rope.integer(
            "original_max_position_embeddings", read.integer("max_position_embeddings", 2048)
        ),
    )


def _rope_number(rope: ConfigReader, rope_type: str, key: str) -> float:
    if rope.config.get(key) is None:
        raise ModelError(f"{rope.source}: rope scaling {rope_type!r} needs {key!r}")
    return rope.number(key)


def _config_dtype(read: ConfigReader) -> str:
    key = "torch_dtype" if read.config.get("torch_dtype") is not None else "dtype"
    name = read.string(key, "float32")
    try:
        return canonical_dtype(name)
    except OptionError:
        raise ModelError(
            f"{read.source}: {key} {name!r} is not supported (llmctl runs float32, "
            "bfloat16 and float16 checkpoints)"
        ) from None


class ConfigReader:
    """Typed reads of one JSON object: a missing key gives the default (JSON null counts
    as missing, as transformers writes it); a wrong type or a value out of range is a
    ModelError naming the file and the key."""

    def __init__(self, config: dict[str, Any], source: str, prefix: str = "") -> None:
        self.config, self.source, self.prefix = config, source, prefix

    def integer(self, key: str, default: Any = REQUIRED, *, minimum: int = 1) -> Any:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        value = self.config.get(key)
        if value is None:
            return self._default(key, default, kind)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self._error(key, kind, value)
        return value

    def number(self, key: str, default: Any = REQUIRED) -> Any:
        value = self.config.get(key)
        if value is None:
            return self._default(key, default, "a positive number")
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 < value < math.inf
        ):
            raise self._error(key, "a positive number", value)
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        return self._typed(key, default, bool, "true or false")

    def string(self, key: str, default: Any) -> Any:
        return self._typed(key, default, str, "a string")

    def _typed(self, key: str, default: Any, kind: type, expected: str) -> Any:
        """The value of ``key``, which must be a ``kind`` (``default`` when absent)."""
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, kind):
            raise self._error(key, expected, value)
        return value

    def _default(self, key: str, default: Any, kind: str) -> Any:
        if default is REQUIRED:
            raise self._error(key, kind, None)
        return default

    def _error(self, key: str, kind: str, value: Any) -> ModelError:
        return ModelError(
            f"{self.source}: {self.prefix + key!r} must be {kind}, got {describe(value)}"
        )


def token_ids(value: Any, source: str, key: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """A token id or a list of them (eos_token_id), each checked against the vocabulary."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelError(
            f"{source}: {key!r} must be a token id or a list of them, got {describe(value)}"
        )
    if vocab_size is not None and any(i >= vocab_size for i in ids):
        raise ModelError(
            f"{source}: {key} {value} is outside the vocabulary (vocab_size {vocab_size})"
        )
    return tuple(ids)
