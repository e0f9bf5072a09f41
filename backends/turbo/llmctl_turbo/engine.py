"""Build the turbo backend's engine: native-step runner + KV-cache plan + shared engine core.

Everything but the model runner is shared with the torch backend: scheduler, block
manager, sampler, tokenizer and the async loop come from ``llmctl.engine``.
"""

from __future__ import annotations

import torch

from llmctl.backend import Hardware, ModelInfo
from llmctl.engine.assemble import EngineSettings, assemble_engine, engine_dtype
from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.model_config import ModelConfig
from llmctl_turbo.plugin import TurboConfig
from llmctl_turbo.runner import TurboModelRunner


def create_turbo_engine(model: ModelInfo, config: TurboConfig, hardware: Hardware) -> AsyncEngine:
    """Load ``model`` with the turbo runner and wrap it in the shared async engine."""
    model_config = ModelConfig.from_dir(model.path)
    device = torch.device(hardware.device_for(config.device))
    max_model_len = model_config.session_len(config.session_len)
    runner = TurboModelRunner(
        model.path,
        model_config,
        dtype=engine_dtype(config.dtype, model_config, device),
        device=device,
        block_size=config.cache_block_seq_len,
        max_model_len=max_model_len,
    )
    settings = EngineSettings(
        block_size=config.cache_block_seq_len,
        kv_budget=config.cache_max_entry_count,
        max_model_len=max_model_len,
        max_num_seqs=config.max_batch_size,
        max_num_batched_tokens=config.max_prefill_token_num,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        chat_template=config.chat_template,
        model_name=config.model_name or model.name,
    )
    return assemble_engine(model, model_config, runner, settings, device)
