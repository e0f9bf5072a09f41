"""LoRA adapters in PEFT's format, read and checked without torch.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``...) and ``adapter_model.safetensors`` with ``<module>.lora_A.weight
[r, in]`` and ``<module>.lora_B.weight [out, r]`` for each adapted linear layer, under
PEFT's prefix ``base_model.model.``. ``read_adapter`` checks all of it against the base
model's shapes (``llmctl.model.check.expected_tensors``) and against ``max_lora_rank``
before any weight is read, with the model check's style of message: the file, what is
wrong, what to do. An adapter is applied beside the base weights, never merged:
``y = base(x) + scale * B @ (A @ x)``, ``scale = lora_alpha / r`` (``/ sqrt(r)`` with
rsLoRA).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import ModelError
from llmctl.model.check import expected_tensors
from llmctl.model.config import ModelConfig
from llmctl.model.weights import read_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT saves module names under its wrapper's prefix
# The linear layers an adapter may adapt (HF names), as they sit in a decoder layer.
TARGET_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: where it is, its rank and scale, and the tensor names of each
    module it adapts (``model.layers.0.self_attn.q_proj`` -> (A's name, B's name))."""

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    modules: dict[str, tuple[str, str]]

    @property
    def scale(self) -> float:
        """What ``B @ A`` is multiplied by: ``alpha / r``, or ``alpha / sqrt(r)`` (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> AdapterSpec:
    """The adapter at ``path``, checked against the base model ``config`` and the largest
    rank served; a ``ModelError`` names what does not fit."""
    path = Path(path).expanduser()
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise ModelError(
            f"LoRA adapter {path} {what}: give a PEFT adapter directory "
            f"({CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    adapter = _read_config(path)
    rank = adapter["r"]
    if rank > max_rank:
        raise ModelError(
            f"LoRA adapter {path} has rank {rank}, above max_lora_rank {max_rank}: raise "
            f"it (--max-lora-rank {rank})"
        )
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        hint = (
            " It has adapter_model.bin: save it again with safe_serialization=True."
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise ModelError(f"LoRA adapter {path} has no {WEIGHTS_FILE}.{hint}")
    modules = _check_tensors(path, read_header(weights), expected_tensors(config), rank)
    alpha = adapter.get("lora_alpha", rank)
    return AdapterSpec(path, rank, float(alpha), bool(adapter.get("use_rslora")), modules)


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ModelError(
            f"LoRA adapter {path} has no {CONFIG_FILE}: give a PEFT adapter directory "
            f"({CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{file} is not valid JSON ({exc}): save the adapter again") from None
    if not isinstance(config, dict):
        raise ModelError(f"{file} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    refusals = {
        "peft_type": peft_type != "LORA" and f"is {peft_type!r}; only LORA adapters are served",
        "use_dora": config.get("use_dora") and "DoRA adapters are not supported",
        "fan_in_fan_out": config.get("fan_in_fan_out") and "fan_in_fan_out is for GPT-2 models",
        "rank_pattern": config.get("rank_pattern") and "per-module ranks are not supported",
        "alpha_pattern": config.get("alpha_pattern") and "per-module alpha is not supported",
        "bias": config.get("bias", "none") != "none" and "trained biases are not supported",
        "modules_to_save": config.get("modules_to_save")
        and "fully trained modules are not supported",
    }
    for key, reason in refusals.items():
        if reason:
            raise ModelError(f"LoRA adapter {path}: {CONFIG_FILE}: {key}: {reason}")
    rank, alpha = config.get("r"), config.get("lora_alpha", 1)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ModelError(f"LoRA adapter {path}: {CONFIG_FILE} needs a positive integer 'r'")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ModelError(f"LoRA adapter {path}: {CONFIG_FILE}: 'lora_alpha' must be a number")
    return config


def _check_tensors(path: Path, header: dict, base: dict, rank: int) -> dict[str, tuple[str, str]]:
    """Pair each module's A and B and check their shapes against the base weight's."""
    halves: dict[str, dict[str, str]] = {}
    for name in header:
        stem = name.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if stem.endswith(suffix):
                halves.setdefault(stem.removesuffix(suffix), {})[part] = name
                break
        else:
            raise ModelError(
                f"LoRA adapter {path}: tensor {name!r} is not a lora_A/lora_B weight "
                "(embedding LoRA and extra trained tensors are not supported)"
            )
    if not halves:
        raise ModelError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, pair in halves.items():
        if len(pair) != 2:
            raise ModelError(f"LoRA adapter {path}: {module} lacks lora_A or lora_B")
        if not module.endswith(TARGET_MODULES):
            raise ModelError(
                f"LoRA adapter {path} adapts {module}: only the attention and MLP "
                f"projections ({', '.join(m.split('.')[-1] for m in TARGET_MODULES)}) are "
                "served"
            )
        weight = base.get(f"{module}.weight")
        if weight is None:
            raise ModelError(
                f"LoRA adapter {path} adapts {module}, which the base model does not have: "
                "was it trained for another model?"
            )
        out_features, in_features = weight[0]
        a, b = header[pair["lora_A"]].shape, header[pair["lora_B"]].shape
        if a != (rank, in_features) or b != (out_features, rank):
            raise ModelError(
                f"LoRA adapter {path}: {module} has A {list(a)} and B {list(b)}, which do not "
                f"fit the base model's [{out_features}, {in_features}] weight at rank {rank} "
                f"(expected A [{rank}, {in_features}], B [{out_features}, {rank}]): was it "
                "trained for another model?"
            )
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in halves.items()}


class LoraNameError(ModelError):
    """A name an adapter cannot be served under."""


def check_lora_name(name: str, taken: set[str], model_name: str) -> None:
    """A name an adapter may be served under: not the model's, not another adapter's."""
    if not name or name != name.strip():
        raise LoraNameError(
            f"LoRA adapter name {name!r}: give a non-empty name without surrounding spaces"
        )
    if name == model_name:
        raise LoraNameError(
            f"LoRA adapter name {name!r} is the base model's name: requests could not tell "
            "them apart; choose another name"
        )
    if name in taken:
        raise LoraNameError(
            f"LoRA adapter name {name!r} is already loaded: unload it first, or choose another name"
        )


def adapters_problem(adapters: Mapping[str, str], options: Mapping[str, Any]) -> str | None:
    """The ``lora`` option's check, shared by the backends that serve adapters: each
    adapter checked against the model before anything loads (the same check the runner
    makes when it reads one): files, shapes, rank, name."""
    if not adapters:
        return None
    from llmctl.model.info import resolve_model

    try:
        info = resolve_model(options.get("model") or "demo")
        config = ModelConfig.from_dict(info.config)
    except ModelError:
        return None  # the model's own error is reported where it is loaded
    served = options.get("model_name") or info.name
    taken: set[str] = set()
    try:
        for name, path in adapters.items():
            check_lora_name(name, taken, served)
            taken.add(name)
            read_adapter(path, config, options.get("max_lora_rank", 16))
    except ModelError as exc:
        return str(exc)
    return None
