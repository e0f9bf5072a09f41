"""Put an engine together around a backend's model runner: the part every local backend
shares (KV-cache plan, tokenizer, engine config, async loop)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.config import EngineConfig
from llmctl.engine.kv_cache import plan_kv_cache
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.runner import ModelRunner
from llmctl.engine.tokenizer import Tokenizer
from llmctl.hardware import available_memory_bytes
from llmctl.kv_budget import KVBudget
from llmctl.model_info import ModelInfo

logger = logging.getLogger("llmctl")


class PagedRunner(ModelRunner, Protocol):
    """A runner that sizes and allocates its own KV cache once the plan is known."""

    def kv_bytes_per_block(self) -> int: ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...


@dataclass(frozen=True)
class EngineSettings:
    """The scheduler and cache settings of a local engine, in the shared engine's terms."""

    block_size: int
    kv_budget: KVBudget
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    seed: int
    chat_template: str | None
    model_name: str


def engine_dtype(requested: str, model_config: ModelConfig, device: torch.device) -> str:
    """``auto``: the checkpoint's dtype on GPU; float32 on CPU, where half precision is slow."""
    if requested == "auto" and device.type == "cpu":
        return "float32"
    return model_config.resolve_dtype(requested)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV cache now: on the GPU, or in RAM for the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return available_memory_bytes()


def assemble_engine(
    model: ModelInfo,
    model_config: ModelConfig,
    runner: PagedRunner,
    settings: EngineSettings,
    device: torch.device,
) -> AsyncEngine:
    """Plan and allocate the KV cache, load the tokenizer and start the async engine."""
    plan = plan_kv_cache(
        settings.kv_budget,
        bytes_per_block=runner.kv_bytes_per_block(),
        free_bytes=free_memory_bytes(device),
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
    )
    runner.allocate_kv_cache(plan.num_blocks)
    logger.info("KV cache: %s", plan.describe())

    tokenizer = Tokenizer.from_dir(model.path, chat_template=settings.chat_template)
    eos_ids = model_config.eos_token_ids + tuple(
        i for i in tokenizer.eos_token_ids if i not in model_config.eos_token_ids
    )
    engine_config = EngineConfig(
        block_size=settings.block_size,
        num_blocks=plan.num_blocks,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        eos_token_ids=eos_ids,
        vocab_size=model_config.vocab_size,
        seed=settings.seed,
    )
    return AsyncEngine(LLMEngine(runner, tokenizer, engine_config), model_name=settings.model_name)
