"""Build the torch backend's engine: model runner + KV-cache plan + shared engine core."""

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
from llmctl_torch.plugin import TorchConfig
from llmctl_torch.runner import TorchModelRunner

logger = logging.getLogger("llmctl")


def create_torch_engine(model: ModelInfo, config: TorchConfig, hardware: Hardware) -> AsyncEngine:
    """Load ``model`` with the torch runner and wrap it in the shared async engine."""
    model_config = ModelConfig.from_dir(model.path)
    device = torch.device(resolve_device(config.device, hardware))
    # `auto`: the checkpoint's dtype on GPU; float32 on CPU, where half precision is slow.
    dtype = (
        ("float32" if device.type == "cpu" else model_config.torch_dtype)
        if config.dtype == "auto"
        else config.dtype
    )
    max_model_len = model_config.session_len(config.max_model_len)
    runner = TorchModelRunner(
        model.path,
        model_config,
        dtype=dtype,
        device=device,
        block_size=config.block_size,
        adapters=config.lora_adapters,
    )
    plan = plan_kv_cache(
        config.kv_budget,
        bytes_per_block=runner.kv_bytes_per_block(),
        free_bytes=free_memory_bytes(device),
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
    )
    runner.allocate_kv_cache(plan.num_blocks)
    logger.info("KV cache: %s", plan.describe())

    tokenizer = Tokenizer.from_dir(model.path, chat_template=config.chat_template)
    eos_ids = model_config.eos_token_ids + tuple(
        i for i in tokenizer.eos_token_ids if i not in model_config.eos_token_ids
    )
    engine_config = EngineConfig(
        block_size=config.block_size,
        num_blocks=plan.num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        eos_token_ids=eos_ids,
        vocab_size=model_config.vocab_size,
        seed=config.seed,
    )
    engine = LLMEngine(runner, tokenizer, engine_config)
    return AsyncEngine(engine, model_name=config.served_model_name or model.name)


def resolve_device(device: str, hardware: Hardware) -> str:
    """``auto`` is CUDA when this machine has a GPU, else the CPU."""
    if device == "auto":
        return "cuda" if hardware.cuda_available else "cpu"
    return device


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV cache now: on the GPU, or in RAM for the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return available_memory_bytes()
