"""Rotary-embedding tables for the native kernels, computed the way transformers does.

The kernels read cos and sin from a precomputed ``[max_positions, head_dim]`` table
instead of evaluating trigonometry per token.
"""

from __future__ import annotations

import torch

from llmctl.engine.rope import rope_inv_freq
from llmctl.model.config import ModelConfig


def cos_sin_cache(frequencies: torch.Tensor, max_positions: int) -> torch.Tensor:
    """fp32 ``[max_positions, head_dim]``: cos of every position's angles, then sin.

    The angles are ``position * inv_freq`` in fp32, the product transformers forms, so
    the rotation matches its rotary embedding.
    """
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * frequencies.float()[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


def model_cos_sin_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    frequencies = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return cos_sin_cache(frequencies, max_positions)
