"""The shared engine's own settings, decided once when an engine starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and switches of one engine instance.

    ``num_blocks`` comes from the KV-cache plan (``kv_cache.plan_kv_cache``);
    ``max_model_len`` bounds prompt + generated tokens of one request;
    ``max_num_batched_tokens`` bounds the new tokens of one step (prefill chunks plus
    decodes); ``vocab_size`` is the model's, so prompt ids outside it are refused.
    """

    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_blocks",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
