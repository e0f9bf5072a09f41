"""Build the torch backend's engine: its model runner inside the shared engine core."""

from __future__ import annotations

import torch

from llmctl.backend import Hardware, ModelInfo
from llmctl.engine.assemble import EngineSettings, assemble_engine, engine_dtype
from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.model_config import ModelConfig
from llmctl_torch.plugin import TorchConfig
from llmctl_torch.runner import TorchModelRunner


def create_torch_engine(model: ModelInfo, config: TorchConfig, hardware: Hardware) -> AsyncEngine:
    """Load ``model`` with the torch runner and wrap it in the shared async engine."""
    model_config = ModelConfig.from_dir(model.path)
    device = torch.device(hardware.device_for(config.device))
    max_model_len = model_config.session_len(config.max_model_len)
    runner = TorchModelRunner(
        model.path,
        model_config,
        dtype=engine_dtype(config.dtype, model_config, device),
        device=device,
        block_size=config.block_size,
        adapters=config.lora_adapters,
    )
    settings = EngineSettings(
        block_size=config.block_size,
        kv_budget=config.kv_budget,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        chat_template=config.chat_template,
        model_name=config.served_model_name or model.name,
    )
    return assemble_engine(model, model_config, runner, settings, device)
