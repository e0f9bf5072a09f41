"""``quantization=gguf`` on turbo: the GGUF file's quantized matrices run as their blocks.

Matrices stored as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or the K-quants Q4_K, Q5_K, Q6_K are read
as the file's bytes (``GGUFModel.iter_weights(keep_types=...)``) and repacked once,
exactly, by ``pack_gguf_weight`` (``csrc/cpu/block_layout.h``, ``block_kernels.h``) for
turbo's CPU block kernels. Resident bits per weight (the file's): Q4_0 4.5 (4.5), Q4_1 5
(5), Q4_K 4.625 (4.5), Q8_0 8.5 (8.5); Q5_0 / Q5_1 9 (5.5 / 6), Q5_K 8.625 (5.5), Q6_K
8.5625 (6.5625): their quants a byte each, which the 8-bit kernels multiply without
unpacking. A fused matrix (q/k/v, gate/up) runs as blocks when its parts share one type
or one packed layout (Q8_0 with Q5_0 or Q5_1, Q4_0 with Q4_1: the symmetric types then
keep their offsets, 9 and 5 bits per weight); otherwise, and for every type with no
kernel (Q2_K, Q3_K, IQ types, F16...), it is dequantized to the model dtype as
``quantization=none`` does, and the log line says how many. The embedding table stays
the file's rows for Q8_0 / Q4_0 / Q4_1 (a tied Q8_0 embedding: its bytes twice, as rows
for the lookup and as panels for the LM head), dequantized per token by the lookup;
another type's table is dequantized to the model dtype for the lookup (and still packed
as blocks for a tied LM head).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import torch

from llmctl.errors import ModelError
from llmctl.kv_budget import format_bytes
from llmctl.model.gguf import GGUFBlocks, gguf_file, open_gguf
from llmctl_turbo.build import load_ops

# GGML's type ids of the formats turbo has CPU block kernels for (csrc/kernels.h).
BLOCK_TYPES = {
    **{"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8},
    **{"Q4_K": 12, "Q5_K": 13, "Q6_K": 14},
}
# Those whose rows the embedding lookup reads directly (csrc kernels.h's embedding_gguf).
LOOKUP_TYPES = ("Q4_0", "Q4_1", "Q8_0")

PANEL_WIDTH = 16  # output features per packed panel (csrc/kernels.h's kPanelWidth)

Weight = torch.Tensor | GGUFBlocks


def load_gguf_weights(
    model_path: str | Path, dtype: torch.dtype, keep_types: Collection[str] = tuple(BLOCK_TYPES)
) -> dict[str, Weight]:
    """The file's tensors: those of ``keep_types`` (the CPU kernels' ``BLOCK_TYPES`` unless
    told) as ``GGUFBlocks``, the rest dequantized to ``dtype`` on the CPU."""
    path = gguf_file(model_path)
    if path is None:
        raise ModelError(
            f"quantization=gguf runs the blocks of a GGUF file, and {model_path} is not one; "
            "use quantization none or int8 for a Hugging Face checkpoint"
        )
    return dict(open_gguf(path).iter_weights(dtype, "cpu", keep_types=keep_types))


def mixed_blocks(parts: list[GGUFBlocks], groups: int) -> torch.Tensor | None:
    """Parts of different types packed one by one and joined, where their packed blocks
    share a layout (Q8_0 with Q5_0 / Q5_1: llama.cpp's Q4_K_M often stores v that way
    beside q and k) and every part but the last fills whole 16-feature panels (or each
    part is one of ``groups``); else None. Q8_0 and Q4_0 parts store their offsets, as Q5_0
    and Q4_1 blocks do (``offsets``: the other types pack the same either way)."""
    ops = load_ops()
    packed = [ops.pack_gguf_weight(p.data, BLOCK_TYPES[p.tensor_type], 1, True) for p in parts]
    same_layout = len({p.shape[2] for p in packed}) == 1
    whole_panels = groups == len(parts) or (
        groups == 1 and all(p.shape[0] % PANEL_WIDTH == 0 for p in parts[:-1])
    )
    return torch.cat(packed) if same_layout and whole_panels else None


class BlockPacker:
    """Packs matrices (fused from parts) for turbo's CPU kernels, as blocks where it can,
    counting what ran as which type for the log line."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.kinds: Counter[str] = Counter()
        self.bytes = 0

    def float_matrix(self, part: Weight) -> torch.Tensor:
        return part.dequantize().to(self.dtype) if isinstance(part, GGUFBlocks) else part

    def embedding_table(self, weight: Weight) -> torch.Tensor:
        """The embedding lookup's table: the file's rows (uint8 [vocab, row bytes], read
        by ``llama_step``'s GGUF lookup) for a ``LOOKUP_TYPES`` type, else the float
        matrix."""
        if isinstance(weight, GGUFBlocks) and weight.tensor_type not in LOOKUP_TYPES:
            self.kinds[f"{weight.tensor_type} dequantized (embedding lookup)"] += 1
            table = self.float_matrix(weight)
            self.bytes += table.numel() * table.element_size()
            return table
        if isinstance(weight, GGUFBlocks):
            self.kinds[f"{weight.tensor_type} rows (embedding lookup)"] += 1
            self.bytes += weight.data.numel()
            return weight.data
        return weight

    def pack(self, parts: list[Weight], groups: int = 1) -> torch.Tensor:
        """``torch.cat(parts)`` packed: GGUF blocks when every part is blocks of one type
        (``pack_gguf_weight``), or of types that pack alike (``mixed_blocks``), else the
        dequantized matrix (``pack_linear_weight``)."""
        ops = load_ops()
        types = [p.tensor_type if isinstance(p, GGUFBlocks) else None for p in parts]
        packed = None
        if len(set(types)) == 1 and None not in types:
            kind = types[0]
            raw = torch.cat([p.data for p in parts])
            packed = ops.pack_gguf_weight(raw, BLOCK_TYPES[kind], groups)
        elif None not in types:
            kind = "+".join(types)
            packed = mixed_blocks(parts, groups)
        if packed is None:
            kind = f"dequantized to {str(self.dtype).removeprefix('torch.')}"
            packed = ops.pack_linear_weight(
                torch.cat([self.float_matrix(p) for p in parts]), groups
            )
        self.kinds[kind] += 1
        self.bytes += packed.numel() * packed.element_size()
        return packed

    def log(self) -> None:
        kinds = ", ".join(f"{count} as {kind}" for kind, count in sorted(self.kinds.items()))
        logging.getLogger("llmctl").info(
            "quantization: gguf: %d matrices (%s), %s packed",
            sum(self.kinds.values()),
            kinds,
            format_bytes(self.bytes),
        )
