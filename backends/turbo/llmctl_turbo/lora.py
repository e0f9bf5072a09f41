"""LoRA adapters on turbo's step: batched beside the base weights, never merged.

Each layer has ``max_loras`` slots of A and B for its four matrices (q/k/v and gate/up
fused, as the step runs them), float32 whatever the model dtype (they are small, and
the kernel computes in fp32): ``A [slots, parts * R, in]`` (the parts' A stacked, so one
shrink serves all of them) and ``Bt [slots, R, out]`` (each part's ``B * scale``
transposed, the parts side by side), ``R`` being ``max_lora_rank``. An adapter of a
lower rank, or one that leaves a module out, fills the rest of its slot with zeros. The
native step (``csrc/llama_step.cpp``) adds ``B[slot] @ (A[slot] @ x)`` after each linear
for the tokens of each tile (``llmctl.engine.lora.slot_tiles``: the step's adapted
tokens sorted by slot, one slot per tile), with turbo's CPU kernel
``csrc/cpu/lora_kernels.h``. The base weights may be anything turbo runs (float, int8,
GGUF blocks): the adapter adds to their product.

On CUDA the same slots sit on the GPU and the step passes each token's slot instead of
tiles (``step_slots``: int32 on the device, -1 for the base model); turbo's CUDA kernels
``csrc/cuda/lora.cu`` group a tile's rows by slot themselves, so nothing is sorted on the
host and the launches depend on the token count alone.
"""

from __future__ import annotations

import numpy as np
import torch

from llmctl.engine.lora import FUSED_PARTS, LoraWeights, slot_tiles
from llmctl.model.config import ModelConfig

# Tokens of one slot per tile: enough that a decode step of many requests over a few
# adapters reads each adapter's A and B a handful of times, few enough that the tiles
# spread over the threads.
TILE_ROWS = 8
# The fused modules in the order llama_step reads their slots (csrc/llama_step.cpp).
FUSED_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class TurboLoras:
    """Every layer's LoRA slots, as the flat list ``llama_step`` takes (``tensors``)."""

    def __init__(
        self, config: ModelConfig, max_loras: int, rank: int, device: torch.device | None = None
    ) -> None:
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        hidden, intermediate = config.hidden_size, config.intermediate_size
        # fused module -> (in features, its parts' out features)
        shapes = {
            "self_attn.qkv_proj": (hidden, [q_width, kv_width, kv_width]),
            "self_attn.o_proj": (q_width, [hidden]),
            "mlp.gate_up_proj": (hidden, [intermediate, intermediate]),
            "mlp.down_proj": (intermediate, [hidden]),
        }
        self.max_loras = max_loras
        self.tensors: list[torch.Tensor] = []
        # HF module name -> (its part's rows of A [slots, R, in], columns of Bt [slots, R, out])
        self.targets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(config.num_layers):
            parts = {}
            for fused in FUSED_MODULES:
                in_features, sizes = shapes[fused]
                a = torch.zeros(max_loras, len(sizes) * rank, in_features, device=device)
                bt = torch.zeros(max_loras, rank, sum(sizes), device=device)
                self.tensors += [a, bt]
                offsets = np.cumsum([0, *sizes[:-1]]).tolist()
                parts[fused] = [
                    (a[:, p * rank : (p + 1) * rank], bt[:, :, offset : offset + size])
                    for p, (offset, size) in enumerate(zip(offsets, sizes))
                ]
            for module, (fused, part) in FUSED_PARTS.items():
                self.targets[f"model.layers.{layer}.{module}"] = parts[fused][part]

    def load_slot(self, slot: int, weights: LoraWeights) -> None:
        """Put an adapter (``read_lora_weights``: A ``[r, in]``, scaled B ``[out, r]`` per
        module) in ``slot``; the modules it leaves out, and ranks above its own, are 0. On
        CUDA the copies are ordered after the steps already launched on the stream (pinned
        host weights: without blocking the host)."""
        for module, (a, bt) in self.targets.items():
            a[slot].zero_()
            bt[slot].zero_()
            if module in weights:
                lora_a, lora_b = weights[module]
                rank = lora_a.shape[0]
                a[slot, :rank].copy_(lora_a, non_blocking=True)
                bt[slot, :rank].copy_(lora_b.T, non_blocking=True)

    @staticmethod
    def step_tiles(
        lora_slots: np.ndarray, query_lens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's ``(lora_rows, lora_tiles)`` for ``llama_step`` (None: no adapter)."""
        grouped = slot_tiles(lora_slots, query_lens, TILE_ROWS)
        if grouped is None:
            return None
        order, tiles = grouped
        return (
            torch.from_numpy(order.astype(np.int32)),
            torch.from_numpy(np.ascontiguousarray(tiles, dtype=np.int32)),
        )

    @staticmethod
    def step_slots(
        lora_slots: np.ndarray, query_lens: np.ndarray, device: torch.device
    ) -> torch.Tensor | None:
        """The step's ``lora_slots`` for ``llama_step`` on CUDA: each token's slot (its
        sequence's; -1: none), int32 on ``device`` (None: no token has an adapter)."""
        token_slots = np.repeat(np.asarray(lora_slots, dtype=np.int32), query_lens)
        if (token_slots < 0).all():
            return None
        host = torch.from_numpy(token_slots).pin_memory()  # so the copy does not block
        return host.to(device, non_blocking=True)
