"""LoRA adapters applied in batches beside the base weights, never merged.

Every adapted ``Linear`` of the model (q/k/v, o, gate/up, down; q/k/v and gate/up are
fused, so one layer holds several parts) gets a ``LoraLayer``: ``max_loras`` slots of
``A`` (``[slots, parts * R, in]``, the parts' A stacked so one product serves them all)
and, per part, ``B`` (``[slots, out, R]``, scaled by the adapter's ``alpha / r``, or
``/ sqrt(r)`` with rsLoRA), ``R`` being ``max_lora_rank``. An adapter of a lower rank,
or one that leaves a module out, fills the rest of its slot with zeros. The layer's
output gets ``B[slot] @ (A[slot] @ x)`` added for each token, with the slot of its row:

- on the CPU, where turbo's native ops load (as for attention, ``attention_ops``),
  turbo's own CPU kernel ``lora_add`` (``kernel="native"``): the step's adapted tokens
  sorted by slot into tiles of one slot (``llmctl_turbo.lora.TurboLoras.step_tiles``),
  shrink and expand fused per tile, fp32 slots whatever the model dtype. A decode step
  mixing four adapters costs a few percent of the base layer this way; the matmuls
  below cost a third of it, since a small step's many operations, not its flops, are
  the cost on a CPU;
- on the CPU without turbo, rows are grouped by slot and each group is two small matmuls
  (``index_select`` / ``index_add_`` when the step mixes slots). A small step that mixes
  adapters (decode) instead multiplies every row by every slot's A at once (one
  matmul), zeroes each row's products but for its own slot (a one-hot mask), and adds
  the result times every slot's B (one matmul per part, the slots side by side along
  the rank): ``max_loras`` times the flops, which are a few percent of the base layer's,
  but a handful of operations per layer instead of a handful per slot, and on a CPU a
  small step's many operations, not their flops, are the cost;
- on CUDA, the Triton kernels of ``triton_lora.py`` (punica's segmented idea, SGMV):
  the step's tokens sorted by slot into tiles of one slot each, a "shrink" kernel
  ``h = x @ A[slot].T`` and an "expand" kernel ``out += h @ B[slot].T`` per part.

``LoraContext`` holds the step's grouping, computed once per step from
``StepBatch.lora_slots`` and shared by every layer. A CUDA graph cannot take that
grouping (it is computed on the host, and its size depends on the step): a graph's
inputs carry each token's slot instead (``StepInputs.lora_slots``, a fixed buffer
copied in before each replay), and ``use_slots`` derives everything from it on the
device with fixed shapes: each token its own tile for the Triton kernels (punica's
gathered form, BGMV: a tile of one token, or none for a token without an adapter), a
one-hot of the slots for the torch path. The slots' weights are fixed buffers, so an
adapter put in a slot (``load``) serves the graphs captured before. A weight method (fp or int8) is
untouched: the adapters add to whatever the base product is.

Adapters are read with safetensors into host memory (``llmctl.engine.lora``'s
``read_lora_weights``; pinned on CUDA, so a swap into a slot is an asynchronous copy
ordered after the steps already launched).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmctl.engine.lora import FUSED_PARTS, NO_SLOT, LoraWeights, slot_tiles
from llmctl_torch.linear import Linear

# A CPU step mixing adapters groups its rows by slot from this many tokens per slot on
# (prefill: flops count); a smaller one goes through every slot at once (decode).
GROUPED_TOKENS_PER_SLOT = 64


class LoraContext:
    """Which tokens of the step run with which slot (shared by every ``LoraLayer``).

    ``kernel`` is ``torch`` (matmuls, any device), ``native`` (turbo's CPU kernel) or
    ``triton``."""

    def __init__(
        self, device: torch.device, kernel: str, max_loras: int, dtype: torch.dtype
    ) -> None:
        self.device = device
        self.kernel = kernel
        self.max_loras = max_loras
        self.dtype = dtype
        self.active = False
        # torch: (slot, rows) per slot in the step; rows None when it is every token
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        # torch, several: [tokens, max_loras, 1], 1 at each token's slot, else 0
        self.one_hot: torch.Tensor | None = None
        # triton, native: the adapted tokens sorted by slot, and each tile's (slot, start, end)
        self.tokens: torch.Tensor | None = None
        self.tiles: torch.Tensor | None = None
        if kernel == "native":
            from llmctl_turbo.build import load_ops

            self.lora_add = load_ops().lora_add

    def prepare(self, lora_slots: np.ndarray, query_lens: np.ndarray) -> None:
        """Group the step's tokens by slot (``lora_slots`` per sequence, -1: none)."""
        if self.kernel == "native":
            from llmctl_turbo.lora import TurboLoras

            grouped = TurboLoras.step_tiles(lora_slots, query_lens)
            self.active = grouped is not None
            if self.active:
                self.tokens, self.tiles = grouped
            return
        token_slots = np.repeat(np.asarray(lora_slots, dtype=np.int64), query_lens)
        adapted = np.flatnonzero(token_slots != NO_SLOT)
        self.active = len(adapted) > 0
        if not self.active:
            return
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        slots = token_slots[order]
        starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
        ends = np.r_[starts[1:], len(order)]
        if self.kernel == "torch":
            if len(starts) == 1 and len(order) == len(token_slots):
                self.groups = [(int(slots[0]), None)]
                return
            if len(starts) == 1 or len(token_slots) >= GROUPED_TOKENS_PER_SLOT * self.max_loras:
                rows = torch.from_numpy(order).to(self.device)
                self.groups = [(int(slots[s]), rows[s:e]) for s, e in zip(starts, ends)]
                return
            one_hot = np.zeros((len(token_slots), self.max_loras, 1), dtype=np.float32)
            one_hot[adapted, token_slots[adapted], 0] = 1.0
            self.one_hot = torch.from_numpy(one_hot).to(self.device, self.dtype)
            return
        from llmctl_torch.triton_lora import TILE_ROWS

        order, tiles = slot_tiles(lora_slots, query_lens, TILE_ROWS)
        packed = torch.from_numpy(np.concatenate([order, tiles.reshape(-1)]).astype(np.int32))
        if self.device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        self.tokens, self.tiles = packed[: len(order)], packed[len(order) :].view(3, -1)

    def use_slots(self, token_slots: torch.Tensor) -> None:
        """Each token's slot (``[tokens]`` int32 on the device, -1: none), as a graph's
        inputs hold it: the grouping derived on the device, with fixed shapes and no host
        work (see the module doc), so a graph can capture it."""
        self.active = True
        if self.kernel == "triton":
            self.tokens = torch.arange(token_slots.shape[0], dtype=torch.int32, device=self.device)
            adapted = (token_slots >= 0).to(torch.int32)
            # (slot, start, end): the token alone, or an empty tile (slot 0: stores nothing)
            self.tiles = torch.stack([token_slots.clamp(min=0), self.tokens, self.tokens + adapted])
            return
        slots = torch.arange(self.max_loras, dtype=token_slots.dtype, device=self.device)
        self.one_hot = (token_slots[:, None] == slots).to(self.dtype)[:, :, None]

    def clear(self) -> None:
        self.active = False
        self.groups, self.one_hot, self.tokens, self.tiles = [], None, None, None


class LoraLayer:
    """The slots of one ``Linear`` (see the module doc): ``parts`` are the (start, size)
    of each part's columns in the layer's output."""

    def __init__(
        self,
        context: LoraContext,
        in_features: int,
        parts: list[tuple[int, int]],
        max_loras: int,
        rank: int,
        dtype: torch.dtype,
    ) -> None:
        device = context.device
        self.context = context
        self.rank = rank
        self.parts = parts
        if context.kernel == "native":  # as turbo's lora_add takes them: fp32, B transposed
            self.a = torch.zeros(max_loras, len(parts) * rank, in_features)
            self.bt = torch.zeros(max_loras, rank, sum(size for _, size in parts))
            self.b = [self.bt[:, :, start : start + size].transpose(1, 2) for start, size in parts]
            return
        self.a = torch.zeros(max_loras, len(parts) * rank, in_features, dtype=dtype, device=device)
        # B of each part is stored [out, slots, rank], so that the slots lie side by side
        # along the rank ([out, slots * rank]: the mixed CPU product), and seen as
        # [slots, out, rank] everywhere else.
        self.b_by_rank = [
            torch.zeros(size, max_loras * rank, dtype=dtype, device=device) for _, size in parts
        ]
        self.b = [b.view(b.shape[0], max_loras, rank).transpose(0, 1) for b in self.b_by_rank]

    def load(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put one part's A and B (or zeros: the adapter leaves it out) in ``slot``."""
        rows = self.a[slot, part * self.rank : (part + 1) * self.rank]
        rows.zero_()
        self.b[part][slot].zero_()
        if a is not None:
            rank = a.shape[0]
            rows[:rank].copy_(a, non_blocking=True)
            self.b[part][slot, :, :rank].copy_(b, non_blocking=True)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += B[slot] @ (A[slot] @ x)`` for every adapted token, in place."""
        context = self.context
        if context.kernel == "native":
            starts, sizes = zip(*self.parts)
            context.lora_add(out, x, self.a, self.bt, starts, sizes, context.tokens, context.tiles)
            return
        if context.kernel == "triton":
            from llmctl_torch.triton_lora import lora_expand, lora_shrink

            h = lora_shrink(x, self.a, context.tokens, context.tiles)
            for part, (start, size) in enumerate(self.parts):
                view = out[:, start : start + size]
                lora_expand(h, self.b[part], view, part * self.rank, context.tokens, context.tiles)
            return
        rank = self.rank
        if context.one_hot is not None:  # several slots: every row through every slot
            num_tokens, slots = x.shape[0], context.max_loras
            h = (x @ self.a.view(slots * self.a.shape[1], -1).T).view(num_tokens, slots, -1)
            h = h * context.one_hot
            for part, (start, size) in enumerate(self.parts):
                own = h[:, :, part * rank : (part + 1) * rank].reshape(num_tokens, slots * rank)
                out[:, start : start + size] += own @ self.b_by_rank[part].T
            return
        for slot, rows in context.groups:
            xs = x if rows is None else x.index_select(0, rows)
            h = xs @ self.a[slot].T
            for part, (start, size) in enumerate(self.parts):
                delta = h[:, part * rank : (part + 1) * rank] @ self.b[part][slot].T
                view = out[:, start : start + size]
                if rows is None:
                    view += delta
                else:
                    view.index_add_(0, rows, delta)


class ModelLoras:
    """Every ``LoraLayer`` of a model and the step's ``LoraContext``."""

    def __init__(
        self, model: nn.Module, max_loras: int, rank: int, dtype: torch.dtype, kernel: str
    ) -> None:
        device = next(model.parameters()).device
        self.context = LoraContext(device, kernel, max_loras, dtype)
        self.max_loras = max_loras
        # HF module name -> (its layer's LoraLayer, its part)
        self.targets: dict[str, tuple[LoraLayer, int]] = {}
        config = model.config
        for index, decoder in enumerate(model.model.layers):
            attention, mlp = decoder.self_attn, decoder.mlp
            sizes = {
                "self_attn.qkv_proj": [attention.q_size, attention.kv_size, attention.kv_size],
                "self_attn.o_proj": [config.hidden_size],
                "mlp.gate_up_proj": [mlp.intermediate_size, mlp.intermediate_size],
                "mlp.down_proj": [config.hidden_size],
            }
            layers = {}
            for fused, part_sizes in sizes.items():
                linear = decoder.get_submodule(fused)
                assert isinstance(linear, Linear)
                offsets = np.cumsum([0, *part_sizes[:-1]]).tolist()
                layers[fused] = linear.lora = LoraLayer(
                    self.context,
                    linear.in_features,
                    list(zip(offsets, part_sizes)),
                    max_loras,
                    rank,
                    dtype,
                )
            for module, (fused, part) in FUSED_PARTS.items():
                self.targets[f"model.layers.{index}.{module}"] = (layers[fused], part)

    def load_slot(self, slot: int, weights: LoraWeights) -> None:
        for module, (layer, part) in self.targets.items():
            a, b = weights.get(module, (None, None))
            layer.load(slot, part, a, b)
