"""``quantization=gguf`` on CUDA, checked without a GPU: the weights turbo places for its
CUDA step (``llmctl_turbo.gguf_cuda``), each layer's fused matrix run through the CUDA
GGUF kernel in the test emulator (tests/backends/turbo/cuda_emulator), against the same
file dequantized by the shared loader (``quantization=none``'s matrices) in float64.

This covers what the kernel tests cannot: which tensors stay blocks, the row order of
fused q/k/v and gate/up, the ``[out, blocks, block bytes]`` view and the un-permuted
q/k rows. On a GPU (marked ``gpu``, skipped elsewhere) the whole runner too: each
position's logits of a prompt (the cuBLAS path) and of decode steps (the GEMV) against
the same file dequantized; scripts/gpu_check_quant.py runs these and times the kernel.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmctl.model.gguf import GGUFBlocks, open_gguf
from tests.gguf.native_runs import greedy, prompt_logits, turbo_runner
from tests.helpers.gguf_blocks import CUDA_GGUF_TYPES
from tests.helpers.kernel_refs import poisoned

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")  # the emulator's "device": the placement is the same


def ggml_type_of(matrix: torch.Tensor) -> int:
    """The GGML type of GGUF rows ``[out, blocks, block bytes]`` (the block sizes of the
    kernel's types all differ)."""
    (kind,) = [
        GGMLQuantizationType[name]
        for name in CUDA_GGUF_TYPES
        if GGML_QUANT_SIZES[GGMLQuantizationType[name]][1] == matrix.shape[2]
    ]
    return kind.value


@pytest.mark.parametrize(
    "kind, tensor_type",
    [("llama-mqa", "Q8_0"), ("qwen2", "Q4_0"), ("llama-mqa", "Q4_1"), ("qwen2", "Q4_K"),
     ("llama-mqa", "Q5_K"), ("llama-mqa", "Q6_K")],
)  # fmt: skip
def test_placed_layers_run_as_the_dequantized_file(emulated, tiny_gguf, kind, tensor_type):
    from llmctl_turbo.gguf_cuda import CudaBlockPlacer, load_cuda_gguf_weights

    _, path = tiny_gguf(kind, tensor_type)
    weights = load_cuda_gguf_weights(path, torch.float32, CPU)
    reference = dict(open_gguf(path).iter_weights(torch.float32))
    placer = CudaBlockPlacer(torch.float32, CPU)
    generator = torch.Generator().manual_seed(len(tensor_type))
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    fused = {
        "qkv": [f"{attn}{p}_proj.weight" for p in "qkv"],
        "o_proj": [attn + "o_proj.weight"],
        "gate_up": [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
        "down": [mlp + "down_proj.weight"],
    }
    for what, names in fused.items():
        matrix = placer.pack([weights[n] for n in names], groups=2 if what == "gate_up" else 1)
        want = torch.cat([reference[n] for n in names]).double()
        assert matrix.dtype == torch.uint8, f"{what} of a {tensor_type} file stays blocks"
        x = torch.randn(3, want.shape[1], generator=generator)
        out = poisoned(3, want.shape[0])
        emulated.gguf_linear(out, x, matrix.flatten(1), ggml_type_of(matrix))
        expected = x.double() @ want.T
        scale = expected.abs().max().item()
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * scale)
    # The lookup's table: dequantized (there is no GGUF lookup kernel on CUDA), exactly.
    stored = weights["model.embed_tokens.weight"]
    embed = placer.embedding_table(stored)
    torch.testing.assert_close(embed, reference["model.embed_tokens.weight"], rtol=0, atol=0)
    assert placer.kinds[tensor_type] == len(fused)
    assert sum(placer.kinds.values()) == len(fused) + isinstance(stored, GGUFBlocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
@pytest.mark.parametrize("kind, tensor_type", [("llama-mqa", "Q8_0"), ("qwen2", "Q4_K")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_on_gpu_matches_the_dequantized_file(tiny_gguf, kind, tensor_type, dtype):
    """turbo's CUDA step with the file's blocks against the same file dequantized to
    ``dtype`` (``quantization=none``) on the same GPU: a 40-token prompt's logits (the
    prompt path: dequantized per layer for cuBLAS, so identical up to summation order) and,
    in float32, greedy decode steps (the GEMV, replayed as CUDA graphs: its fp32 weights
    are not the bf16 reference's, so bf16 decode is left to the kernel tests)."""
    _, path = tiny_gguf(kind, tensor_type)
    native = turbo_runner(path, "gguf", 128, dtype=dtype, device="cuda")
    reference = turbo_runner(path, "none", 128, dtype=dtype, device="cuda")
    ids = [(17 * i + 5) % 400 + 1 for i in range(40)]
    got, want = prompt_logits(native, ids), prompt_logits(reference, ids)
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error < (1e-4 if dtype == "float32" else 3e-2)
    if dtype == "float32":  # near-ties of a random model aside, the same tokens
        steps = greedy(native, ids[:8], 16), greedy(reference, ids[:8], 16)
        assert sum(a == b for a, b in zip(*steps, strict=True)) >= 14
