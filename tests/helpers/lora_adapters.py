"""LoRA adapters made with ``peft`` on a tiny model (``tests.helpers.tiny_models``), with
fresh random weights (peft starts B at zero, which would make an adapter a no-op). The
peft model returned is the reference of the LoRA tests (``hf_greedy`` runs it)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny_models import load_hf_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(
    directory: Path,
    model_dir: Path,
    *,
    rank: int,
    target_modules: list[str],
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 0,
    spread: float = 0.15,
):
    """Save a random peft LoRA adapter of ``model_dir`` into ``directory``; return the
    peft model (the base with the adapter), for reference outputs."""
    from peft import LoraConfig, get_peft_model

    base = load_hf_model(model_dir)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        use_rslora=use_rslora,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(spread * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def write_small_adapter(directory: Path, model_dir: Path, rank: int = 2) -> Path:
    """A random adapter of ``model_dir``'s q_proj layers written by hand (no peft, no
    model loaded): for tests of the option checks."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from llmctl.model.check import expected_tensors
    from llmctl.model.config import ModelConfig

    rng = np.random.default_rng(0)
    tensors = {}
    for name, (shape, _) in expected_tensors(ModelConfig.from_dir(model_dir)).items():
        if name.endswith("q_proj.weight"):
            module = "base_model.model." + name.removesuffix(".weight")
            out_features, in_features = shape
            tensors[f"{module}.lora_A.weight"] = rng.standard_normal((rank, in_features), "f4")
            tensors[f"{module}.lora_B.weight"] = rng.standard_normal((out_features, rank), "f4")
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def free_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """``num_tokens`` greedy tokens of ``model`` (transformers, with or without peft),
    EOS included like any other token (what ``ignore_eos`` serves)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]
