"""What the shared engine reads from a backend's own configuration.

Each local backend translates the unified options once, into a config in its own
names (turbo's are TurboMind's, torch's vLLM's), and its engine consumes that config.
The shared parts (KV plan, scheduler, block manager, sampler, tokenizer) read the
fields below from it: torch's config has them as fields, turbo's as properties over
its own names. Nothing is copied into a second structure.
"""

from __future__ import annotations

from typing import Protocol

from llmctl.kv_budget import KVBudget


class EngineOptions(Protocol):
    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block (``cache_block_seq_len``)."""

    @property
    def kv_budget(self) -> KVBudget:
        """How much memory the KV cache may take (``cache_max_entry_count``)."""

    @property
    def max_model_len(self) -> int | None:
        """Longest session asked for (``session_len``); ``None``: the model's own."""

    @property
    def max_num_seqs(self) -> int:
        """Most sequences in one step (``max_batch_size``)."""

    @property
    def max_num_batched_tokens(self) -> int:
        """Most new tokens in one step (``max_prefill_token_num``)."""

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def seed(self) -> int: ...

    @property
    def dtype(self) -> str:
        """``auto`` or a dtype name."""

    @property
    def device(self) -> str:
        """``auto``, ``cpu`` or ``cuda``."""

    @property
    def chat_template(self) -> str | None: ...

    @property
    def served_model_name(self) -> str | None:
        """The API's model name (``model_name``); ``None``: the model argument."""
