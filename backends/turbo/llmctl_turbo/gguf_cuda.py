"""``quantization=gguf`` on CUDA: the file's quantized matrices stay its blocks, as stored.

Matrices stored as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K go to the GPU as the file's rows
viewed as uint8 ``[out, blocks, block bytes]`` (``csrc/kernels.h``), which
``csrc/cuda/gguf_linear.cu`` reads in decode and dequantizes for cuBLAS in prompt-sized
batches: no repacking, the file's bytes are the weight's memory. A fused matrix (q/k/v,
gate/up) stays blocks when its parts share one type; otherwise, and for other types, it
is dequantized to the model dtype. The embedding table is dequantized to the model dtype
(the lookup has no GGUF kernel on CUDA); a tied LM head still runs as blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmctl.model.gguf import GGUFBlocks
from llmctl_turbo.gguf_weights import BlockPacker, Weight, load_gguf_weights

# The types of csrc/gguf_types.h, by GGML's name.
CUDA_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def load_cuda_gguf_weights(
    model_path: str | Path, dtype: torch.dtype, device: torch.device
) -> dict[str, Weight]:
    """The file's tensors: ``CUDA_BLOCK_TYPES`` matrices as ``GGUFBlocks`` (still on the
    CPU: ``CudaBlockPlacer`` moves what it keeps), the rest in ``dtype`` on ``device``."""
    weights = load_gguf_weights(model_path, dtype, keep_types=CUDA_BLOCK_TYPES)
    return {name: w if isinstance(w, GGUFBlocks) else w.to(device) for name, w in weights.items()}


class CudaBlockPlacer(BlockPacker):
    """``BlockPacker`` for the CUDA kernels: the same choice (blocks when every part is
    blocks of one type), the file's rows instead of CPU panels, on ``device``."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype)
        self.device = device

    def embedding_table(self, weight: Weight) -> torch.Tensor:
        table = self.float_matrix(weight).to(self.device)
        if isinstance(weight, GGUFBlocks):
            dtype = str(self.dtype).removeprefix("torch.")
            self.kinds[f"{weight.tensor_type} dequantized to {dtype} (embedding lookup)"] += 1
            self.bytes += table.numel() * table.element_size()
        return table

    def pack(self, parts: list[Weight], groups: int = 1) -> torch.Tensor:
        """``torch.cat(parts)`` on the device: ``[out, blocks, block bytes]`` GGUF rows, or
        the dequantized matrix. ``groups`` needs nothing here: the rows of [gate; up] stay
        in order, unpacked."""
        types = {p.tensor_type if isinstance(p, GGUFBlocks) else None for p in parts}
        kind = next(iter(types)) if len(types) == 1 else None
        if kind in CUDA_BLOCK_TYPES:
            block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
            raw = torch.cat([p.data for p in parts])
            matrix = raw.view(raw.shape[0], -1, block_bytes).to(self.device)
        else:
            kind = f"dequantized to {str(self.dtype).removeprefix('torch.')}"
            matrix = torch.cat([self.float_matrix(p).to(self.device) for p in parts])
        self.kinds[kind] += 1
        self.bytes += matrix.numel() * matrix.element_size()
        return matrix
