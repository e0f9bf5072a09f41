"""Put an engine together around a backend's model runner: the part every local backend
shares (model config, dtype and device, KV-cache plan, tokenizer, async loop)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.config import EngineConfig
from llmctl.engine.kv_cache import plan_kv_cache
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.lora import LoraRunner
from llmctl.engine.runner import PagedRunner
from llmctl.errors import OptionError
from llmctl.hardware import Hardware, available_memory_bytes
from llmctl.model.config import ModelConfig
from llmctl.model.info import ModelInfo, resolve_model
from llmctl.model.tokenizer import Tokenizer

logger = logging.getLogger("llmctl")

# Loads a backend's runner: (model, its config, engine config, dtype name, device,
# session length) -> runner. The engine config is the one the engine gets too; the model
# is the one served, or the draft model of speculative_method=draft.
RunnerLoader = Callable[[ModelInfo, ModelConfig, EngineConfig, str, torch.device, int], PagedRunner]


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
    tokenizer = Tokenizer.from_dir(model.path, chat_template=config.chat_template)
    draft = None
    if config.speculation.method == "draft":
        draft = draft_model(config.speculation.model, tokenizer)
    runner = load_runner(model, model_config, config, dtype, device, max_model_len)
    if config.lora.adapters and runner.serves_lora:  # before the cache takes the memory
        cast(LoraRunner, runner).allocate_lora_slots()
    runners = [runner]
    if draft is not None:  # its cache has the same blocks: the plan counts both
        draft_config = ModelConfig.from_dir(draft.path)
        runners.append(load_runner(draft, draft_config, config, dtype, device, max_model_len))
    plan = plan_kv_cache(
        config.kv_budget,
        bytes_per_block=sum(r.kv_bytes_per_block() for r in runners),
        free_bytes=free_memory_bytes(device),
        block_size=runner.block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        element=runner.kv_element(),
    )
    for each in runners:
        each.allocate_kv_cache(plan.num_blocks)
    logger.info("KV cache: %s", plan.describe())

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
        draft_runner=runners[1] if draft is not None else None,
    )
    async_engine = AsyncEngine(engine, model_name=config.served_model_name or model.name)
    for name, path in config.lora.adapters:  # served from the start
        try:
            async_engine.load_lora_now(name, path)
        except BaseException:
            async_engine.stop_now()
            raise
    return async_engine


def draft_model(argument: str, tokenizer: Tokenizer) -> ModelInfo:
    """The draft model of ``speculative_model=argument``, loadable and with exactly the
    served model's vocabulary (its tokens are proposed as the served model's)."""
    draft = resolve_model(argument)
    draft.ensure_loadable()
    vocab = Tokenizer.from_dir(draft.path).hf_tokenizer.get_vocab()
    served = tokenizer.hf_tokenizer.get_vocab()
    if vocab != served:
        differing = sorted(set(vocab.items()) ^ set(served.items()), key=lambda item: item[1])
        token, token_id = differing[0]
        raise OptionError(
            f"speculative_model {argument!r} does not share the model's tokenizer: its "
            f"vocabulary has {len(vocab)} tokens, the model's {len(served)}, and they differ "
            f"at id {token_id} ({token!r}); a draft model must propose the served model's "
            "tokens: choose one of the same family and tokenizer"
        )
    return draft
