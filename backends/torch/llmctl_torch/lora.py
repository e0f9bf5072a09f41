"""LoRA adapters (PEFT format), merged into the base weights at load.

An adapter directory holds ``adapter_config.json`` (r, lora_alpha, target_modules...)
and ``adapter_model.safetensors`` with ``<module>.lora_A.weight [r, in]`` and
``<module>.lora_B.weight [out, r]`` for each adapted linear layer. Merging adds
``B @ A * lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) to the module's weight, so the
adapted model runs exactly as fast as the base one. One adapter per engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmctl.errors import ModelError, OptionError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT saves module names under the wrapper's prefix.
PEFT_PREFIX = "base_model.model."


def apply_lora_adapters(weights: dict[str, torch.Tensor], adapters: Sequence[str | Path]) -> None:
    """Merge the adapters (at most one) into ``weights`` (HF names), in place."""
    if len(adapters) > 1:
        raise OptionError(
            f"adapters: the torch backend merges one LoRA adapter into the weights at load, "
            f"got {len(adapters)}; pass a single adapter directory"
        )
    for adapter in adapters:
        merge_lora(weights, Path(adapter))


def merge_lora(weights: dict[str, torch.Tensor], adapter_dir: Path) -> None:
    """Add each adapted module's ``B @ A * scale`` to its weight (computed in fp32)."""
    config = _read_adapter_config(adapter_dir)
    tensors = _read_adapter_weights(adapter_dir)
    alpha = float(config.get("lora_alpha", config["r"]))
    for module, (lora_a, lora_b) in _pair_lora_tensors(tensors, adapter_dir).items():
        target = f"{module}.weight"
        if target not in weights:
            raise ModelError(
                f"LoRA adapter {adapter_dir} adapts {module}, which the base model does not "
                "have: was it trained for a different model?"
            )
        base = weights[target]
        rank = lora_a.shape[0]
        if lora_b.shape[1] != rank or (lora_b.shape[0], lora_a.shape[1]) != tuple(base.shape):
            raise ModelError(
                f"LoRA adapter {adapter_dir}: {module} has A {tuple(lora_a.shape)} and B "
                f"{tuple(lora_b.shape)}, which do not fit the base weight {tuple(base.shape)}"
            )
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        delta = lora_b.float().to(base.device) @ lora_a.float().to(base.device)
        weights[target] = (base.float() + delta * scale).to(base.dtype)


def _read_adapter_config(adapter_dir: Path) -> dict:
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise ModelError(
            f"LoRA adapter {adapter_dir} has no {CONFIG_FILE}: give a PEFT adapter directory "
            f"({CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    config = json.loads(path.read_text())
    peft_type = config.get("peft_type", "LORA")
    refusals = {
        "peft_type": peft_type != "LORA" and f"is {peft_type!r}; only LORA adapters merge",
        "use_dora": config.get("use_dora") and "DoRA adapters are not supported",
        "fan_in_fan_out": config.get("fan_in_fan_out") and "fan_in_fan_out is for GPT-2 models",
        "alpha_pattern": config.get("alpha_pattern") and "per-module alpha is not supported",
        "bias": config.get("bias", "none") != "none" and "trained biases are not supported",
        "modules_to_save": config.get("modules_to_save")
        and "fully trained modules are not supported",
    }
    for key, reason in refusals.items():
        if reason:
            raise ModelError(f"LoRA adapter {adapter_dir}: {key}: {reason}")
    if not isinstance(config.get("r"), int) or config["r"] <= 0:
        raise ModelError(f"LoRA adapter {adapter_dir}: {CONFIG_FILE} needs a positive integer 'r'")
    return config


def _read_adapter_weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        hint = (
            " It has adapter_model.bin: convert it to safetensors first."
            if (adapter_dir / "adapter_model.bin").is_file()
            else ""
        )
        raise ModelError(f"LoRA adapter {adapter_dir} has no {WEIGHTS_FILE}.{hint}")
    return load_file(str(path))


def _pair_lora_tensors(
    tensors: dict[str, torch.Tensor], adapter_dir: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` from PEFT names like ``base_model.model.X.lora_A.weight``."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        stem = name.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if stem.endswith(suffix):
                halves.setdefault(stem.removesuffix(suffix), {})[part] = tensor
                break
        else:
            raise ModelError(
                f"LoRA adapter {adapter_dir}: tensor {name!r} is not a lora_A/lora_B weight "
                "(embedding LoRA and extra trained tensors are not supported)"
            )
    incomplete = [m for m, h in halves.items() if len(h) != 2]
    if incomplete:
        raise ModelError(f"LoRA adapter {adapter_dir}: {incomplete[0]} lacks lora_A or lora_B")
    return {module: (h["lora_A"], h["lora_B"]) for module, h in halves.items()}
