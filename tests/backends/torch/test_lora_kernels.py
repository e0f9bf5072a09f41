"""The batched LoRA products (``llmctl_torch.lora``): the grouped torch path, turbo's CPU
kernel (``native``) and the Triton kernels (run by Triton's interpreter without a GPU) against a plain per-token
reference in float64, on random inputs, several shapes and ranks, with rows of mixed
slots, rows without an adapter, and fused layers (several parts in one output)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from llmctl_torch import triton_lora  # first: it switches Triton's interpreter on
from llmctl_torch.lora import LoraContext, LoraLayer

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# turbo's lora_add serves the torch backend's CPU steps (as its attention ops do)
KERNELS = ["torch", "triton", *(["native"] if DEVICE.type == "cpu" else [])]


def reference(x, out, layer: LoraLayer, token_slots):
    """``out + B[slot] @ (A[slot] @ x)`` token by token, in float64."""
    want = out.double().clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        h = layer.a[slot].double() @ x[t].double()
        for part, (start, size) in enumerate(layer.parts):
            hp = h[part * layer.rank : (part + 1) * layer.rank]
            want[t, start : start + size] += layer.b[part][slot].double() @ hp
    return want


def random_layer(kernel, in_features, part_sizes, slots, rank, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    context = LoraContext(DEVICE, kernel, slots, dtype)
    offsets = np.cumsum([0, *part_sizes[:-1]]).tolist()
    layer = LoraLayer(context, in_features, list(zip(offsets, part_sizes)), slots, rank, dtype)
    for slot in range(slots):
        for part in range(len(part_sizes)):
            r = int(torch.randint(1, rank + 1, (), generator=g))  # any rank up to the slot's
            a = torch.randn(r, in_features, generator=g)
            b = torch.randn(part_sizes[part], r, generator=g)
            layer.load(slot, part, a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE))
    return layer, g


# (in_features, parts' sizes, slots, max rank, sequences' query lengths)
SHAPES = [
    (64, [64], 2, 8, [1, 1, 1, 1, 1]),  # decode, one part
    (64, [64, 32, 32], 4, 16, [5, 1, 17, 1]),  # fused q/k/v, prefill chunks and decodes
    (96, [96, 96], 3, 4, [33, 2, 1]),  # fused gate/up, rank below the tile
    (40, [24], 4, 32, [3, 1, 1, 20, 1, 1]),  # shapes off the tiles, rank 32
    (128, [200], 1, 64, [1, 40]),  # one slot, wide output, rank 64
    (64, [64, 32], 2, 8, [100, 1, 40]),  # a long mixed step: the CPU groups rows by slot
    (32, [48], 2, 128, [2, 1, 3]),  # rank 128: the kernels walk the rank in blocks
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_batched_lora_matches_the_per_token_reference(kernel, shape):
    in_features, part_sizes, slots, rank, query_lens = shape
    layer, g = random_layer(kernel, in_features, part_sizes, slots, rank, torch.float32, 1)
    seq_slots = torch.randint(-1, slots, (len(query_lens),), generator=g).numpy()
    seq_slots[0] = slots - 1  # at least one adapted row
    token_slots = np.repeat(seq_slots, query_lens)
    num_tokens = int(sum(query_lens))
    x = torch.randn(num_tokens, in_features, generator=g).to(DEVICE)
    out = torch.randn(num_tokens, sum(part_sizes), generator=g).to(DEVICE)
    want = reference(x.cpu(), out.cpu(), layer, token_slots)
    layer.context.prepare(seq_slots, np.array(query_lens))
    assert layer.context.active
    layer.apply(x, out)
    magnitude = want.abs().max()
    assert torch.allclose(out.double().cpu(), want, atol=1e-4 * float(magnitude), rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_without_an_adapter_are_untouched(kernel):
    layer, g = random_layer(kernel, 32, [32, 16], 2, 8, torch.float32, 2)
    x = torch.randn(6, 32, generator=g).to(DEVICE)
    out = torch.randn(6, 48, generator=g).to(DEVICE)
    before = out.clone()
    layer.context.prepare(np.array([-1, 1, -1]), np.array([2, 3, 1]))
    layer.apply(x, out)
    assert torch.equal(out[:2], before[:2]) and torch.equal(out[5:], before[5:])
    assert not torch.allclose(out[2:5], before[2:5])
    layer.context.prepare(np.array([-1, -1]), np.array([2, 1]))
    assert not layer.context.active  # a step of base rows only skips the adapters


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=[f"shape{i}" for i in range(4)])
def test_a_graphs_per_token_slots_match_the_reference(kernel, shape):
    """The form a CUDA graph captures (``use_slots``: each token's slot in a device
    tensor, the grouping derived there with fixed shapes) gives the per-token reference,
    rows without an adapter (slot -1, as a graph's padding) untouched."""
    in_features, part_sizes, slots, rank, query_lens = shape
    layer, g = random_layer(kernel, in_features, part_sizes, slots, rank, torch.float32, 4)
    num_tokens = int(sum(query_lens))
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    token_slots[0], token_slots[-1] = slots - 1, -1
    x = torch.randn(num_tokens, in_features, generator=g).to(DEVICE)
    out = torch.randn(num_tokens, sum(part_sizes), generator=g).to(DEVICE)
    want = reference(x.cpu(), out.cpu(), layer, token_slots.tolist())
    layer.context.use_slots(token_slots.to(torch.int32).to(DEVICE))
    layer.apply(x, out)
    layer.context.clear()
    magnitude = want.abs().max()
    assert torch.allclose(out.double().cpu(), want, atol=1e-4 * float(magnitude), rtol=1e-5)
    base = token_slots < 0
    assert torch.equal(out.cpu()[base].double(), want[base])


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "torch"])
def test_kernels_take_bfloat16(kernel):
    """bf16 weights and activations (the GPU's dtype): within bf16's rounding of the output."""
    layer, g = random_layer(kernel, 64, [64, 32], 3, 16, torch.bfloat16, 3)
    seq_slots, query_lens = np.array([0, 2, 1, 2]), np.array([1, 4, 1, 18])
    x = torch.randn(24, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    out = torch.randn(24, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    want = reference(x.cpu(), out.cpu(), layer, np.repeat(seq_slots, query_lens))
    layer.context.prepare(seq_slots, query_lens)
    layer.apply(x, out)
    error = (out.double().cpu() - want).abs().max()
    assert error <= 1e-2 * want.abs().max()


def compile_for_nvidia_gpus() -> None:
    """Compile both kernels for sm_80 and sm_90 with Triton's own ptxas (no GPU needed),
    in bf16, fp16 and fp32. Runs in a child process started with ``TRITON_INTERPRET=0``."""
    from llmctl_torch.triton_common import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_kernel(fn, types: dict[str, str], constants: dict, arch: int) -> None:
        signature = {
            p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in fn.params
        }
        source = ASTSource(fn, signature, constexprs=constants)
        triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))

    indices = {"tokens_ptr": "*i32", "tiles_ptr": "*i32"}
    for arch, dtype in ((90, "bf16"), (80, "fp16"), (80, "fp32")):
        weights = f"*{dtype}"
        compile_kernel(
            triton_lora._lora_shrink_kernel,
            indices | {"x_ptr": weights, "a_ptr": weights, "h_ptr": "*fp32"},
            dict(UPCAST=False, BLOCK_M=16, BLOCK_R=64, BLOCK_K=32),
            arch,
        )
        compile_kernel(
            triton_lora._lora_expand_kernel,
            indices | {"h_ptr": "*fp32", "b_ptr": weights, "out_ptr": weights},
            dict(UPCAST=False, BLOCK_M=16, BLOCK_R=16, BLOCK_N=64),
            arch,
        )


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the other tests compile for real")
def test_kernels_compile_for_nvidia_gpus_without_one():
    """The interpreter accepts code the GPU compiler refuses: compile for real."""
    repo = Path(__file__).resolve().parents[3]
    path = os.pathsep.join([str(repo), str(repo / "backends" / "torch")])
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    code = "import tests.backends.torch.test_lora_kernels as t; t.compile_for_nvidia_gpus()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
