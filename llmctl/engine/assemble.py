"""Put an engine together around a backend's model runner: the part every local backend
shares (model config, dtype and device, KV-cache plan, tokenizer, async loop)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.config import EngineConfig
from llmctl.engine.kv_cache import plan_kv_cache
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.runner import PagedRunner
from llmctl.hardware import Hardware, available_memory_bytes
from llmctl.model.config import ModelConfig
from llmctl.model.info import ModelInfo
from llmctl.model.tokenizer import Tokenizer

logger = logging.getLogger("llmctl")

# Loads a backend's runner: (model config, engine config, dtype name, device, session
# length) -> runner. The engine config is the one the engine gets too.
RunnerLoader = Callable[[ModelConfig, EngineConfig, str, torch.device, int], PagedRunner]


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


def build_engine(
    model: ModelInfo, config: EngineConfig, hardware: Hardware, load_runner: RunnerLoader
) -> AsyncEngine:
    """Load ``model`` with the backend's runner, size and allocate the KV cache, load the
    tokenizer and start the async engine. ``config`` (the backend's ``translate``) goes
    to the runner and to the engine."""
    model_config = ModelConfig.from_dir(model.path)
    device = torch.device(hardware.device_for(config.device))
    max_model_len = model_config.session_len(config.max_model_len)
    dtype = engine_dtype(config.dtype, model_config, device)
    runner = load_runner(model_config, config, dtype, device, max_model_len)
    plan = plan_kv_cache(
        config.kv_budget,
        bytes_per_block=runner.kv_bytes_per_block(),
        free_bytes=free_memory_bytes(device),
        block_size=runner.block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        element=runner.kv_element(),
    )
    runner.allocate_kv_cache(plan.num_blocks)
    logger.info("KV cache: %s", plan.describe())

    tokenizer = Tokenizer.from_dir(model.path, chat_template=config.chat_template)
    eos_ids = model_config.eos_token_ids + tuple(
        i for i in tokenizer.eos_token_ids if i not in model_config.eos_token_ids
    )
    engine = LLMEngine(
        runner,
        tokenizer,
        config,
        max_model_len=max_model_len,
        eos_token_ids=eos_ids,
        vocab_size=model_config.vocab_size,
    )
    async_engine = AsyncEngine(engine, model_name=config.served_model_name or model.name)
    for name, path in config.lora.adapters:  # served from the start
        try:
            async_engine.load_lora_now(name, path)
        except BaseException:
            async_engine.stop_now()
            raise
    return async_engine
