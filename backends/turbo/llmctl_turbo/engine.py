"""Build the turbo backend's engine: native-step runner + KV-cache plan + shared engine core.

Everything but the model runner is shared with the torch backend: scheduler, block
manager, sampler, tokenizer and the async loop come from ``llmctl.engine``.
"""

from __future__ import annotations

import logging

import torch

from llmctl.backend import Hardware, ModelInfo
from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.config import EngineConfig
from llmctl.engine.kv_cache import plan_kv_cache
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.tokenizer import Tokenizer
from llmctl.hardware import available_memory_bytes
from llmctl_turbo.plugin import TurboConfig, uses_cuda
from llmctl_turbo.runner import TurboModelRunner

logger = logging.getLogger("llmctl")


def create_turbo_engine(model: ModelInfo, config: TurboConfig, hardware: Hardware) -> AsyncEngine:
    """Load ``model`` with the turbo runner and wrap it in the shared async engine."""
    model_config = ModelConfig.from_dir(model.path)
    device = torch.device("cuda" if uses_cuda({"device": config.device}, hardware) else "cpu")
    # `auto`: the checkpoint's dtype on GPU; float32 on CPU, where half precision is slow.
    dtype = (
        ("float32" if device.type == "cpu" else model_config.torch_dtype)
        if config.dtype == "auto"
        else config.dtype
    )
    max_model_len = model_config.session_len(config.session_len)
    runner = TurboModelRunner(
        model.path,
        model_config,
        dtype=dtype,
        device=device,
        block_size=config.cache_block_seq_len,
        max_model_len=max_model_len,
    )
    plan = plan_kv_cache(
        config.cache_max_entry_count,
        bytes_per_block=runner.kv_bytes_per_block(),
        free_bytes=free_memory_bytes(device),
        block_size=config.cache_block_seq_len,
        max_num_seqs=config.max_batch_size,
        max_model_len=max_model_len,
    )
    runner.allocate_kv_cache(plan.num_blocks)
    logger.info("KV cache: %s", plan.describe())

    tokenizer = Tokenizer.from_dir(model.path, chat_template=config.chat_template)
    eos_ids = model_config.eos_token_ids + tuple(
        i for i in tokenizer.eos_token_ids if i not in model_config.eos_token_ids
    )
    engine_config = EngineConfig(
        block_size=config.cache_block_seq_len,
        num_blocks=plan.num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=config.max_batch_size,
        max_num_batched_tokens=config.max_prefill_token_num,
        enable_prefix_caching=config.enable_prefix_caching,
        eos_token_ids=eos_ids,
        vocab_size=model_config.vocab_size,
        seed=config.seed,
    )
    engine = LLMEngine(runner, tokenizer, engine_config)
    return AsyncEngine(engine, model_name=config.model_name or model.name)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV cache now: on the GPU, or in RAM for the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return available_memory_bytes()
