"""Rotary-embedding tables for the native kernels, computed the way transformers does.

The kernels read cos and sin from a precomputed ``[max_positions, head_dim]`` table
instead of evaluating trigonometry per token.
"""

from __future__ import annotations

import math

import torch

from llmctl.engine.model_config import ModelConfig, RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 ``[head_dim / 2]`` inverse frequencies: default, ``linear`` or ``llama3``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling is None:
        return freqs
    if scaling.rope_type == "linear":
        return freqs / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"rope scaling {scaling.rope_type!r} is not supported by turbo")
    # llama3: wavelengths longer than the original context / low_freq_factor are slowed
    # by `factor`, shorter than it / high_freq_factor kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, freqs)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(frequencies: torch.Tensor, max_positions: int) -> torch.Tensor:
    """fp32 ``[max_positions, head_dim]``: cos of every position's angles, then sin.

    The angles are ``position * inv_freq`` in fp32, the product transformers forms, so
    the rotation matches its rotary embedding.
    """
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * frequencies.float()[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


def model_cos_sin_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    frequencies = inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return cos_sin_cache(frequencies, max_positions)
