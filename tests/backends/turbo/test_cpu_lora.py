"""turbo's CPU LoRA kernel (``lora_add``, csrc/cpu/lora_kernels.h) against plain torch, on
every instruction set this CPU has: fused parts, tiles of one slot, untouched rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llmctl_turbo.lora import TILE_ROWS

from llmctl.engine.lora import slot_tiles


def reference(out, x, a, bt, out_offsets, sizes, token_slots):
    """``out[t, part p] += (A[s] @ x[t])[p R : (p+1) R] @ Bt[s][:, part p]`` in fp32."""
    want = out.float().clone()
    rank = bt.shape[1]
    b_offsets = np.cumsum([0, *sizes[:-1]])
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        h = a[slot] @ x[t].float()
        for p, (offset, size) in enumerate(zip(out_offsets, sizes)):
            part_b = bt[slot, :, b_offsets[p] : b_offsets[p] + size]
            want[t, offset : offset + size] += h[p * rank : (p + 1) * rank] @ part_b
    return want


@pytest.mark.parametrize("tile_rows", [TILE_ROWS, 16])  # the kernel takes any tile length
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "sizes, out_offsets, width",
    [
        ([40, 24, 24], [0, 40, 64], 88),  # fused q/k/v
        ([37, 37], [0, 48], 85),  # gate/up packed: up after gate's whole panels
        ([70], [0], 70),
    ],
)
def test_lora_add_matches_plain_torch(turbo_ops, isa, dtype, sizes, out_offsets, width, tile_rows):
    gen = torch.Generator().manual_seed(0)
    slots, rank, in_features = 3, 5, 67  # an odd rank, K not a whole number of vectors
    query_lens = np.array([1, 13, 1, 1, 20, 1])  # decode rows and prefill chunks
    lora_slots = np.array([2, 0, -1, 2, 1, -1])
    num_tokens = int(query_lens.sum())
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a = torch.randn(slots, len(sizes) * rank, in_features, generator=gen)
    bt = torch.randn(slots, rank, sum(sizes), generator=gen)
    out = torch.randn(num_tokens, width, generator=gen).to(dtype)
    token_slots = np.repeat(lora_slots, query_lens)
    want = reference(out, x, a, bt, out_offsets, sizes, token_slots)
    order, tiles = slot_tiles(lora_slots, query_lens, tile_rows)
    assert (tiles[2] - tiles[1]).max() == tile_rows
    before = out.clone()
    turbo_ops.lora_add(
        out,
        x,
        a,
        bt,
        out_offsets,
        sizes,
        torch.from_numpy(order.astype(np.int32)),
        torch.from_numpy(tiles.astype(np.int32)),
    )
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tolerance * 10, rtol=tolerance)
    base = torch.from_numpy(token_slots < 0)
    assert torch.equal(out[base], before[base])  # rows without an adapter untouched


def test_lora_add_refuses_tiles_outside_the_step(turbo_ops):
    x, out = torch.randn(4, 8), torch.zeros(4, 6)
    a, bt = torch.zeros(2, 2, 8), torch.zeros(2, 2, 6)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    bad_slot = torch.tensor([[2], [0], [2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="slot 2 is not one of the 2 LoRA slots"):
        turbo_ops.lora_add(out, x, a, bt, [0], [6], rows, bad_slot)
    with pytest.raises(RuntimeError, match="lora_rows\\[1\\] = 9"):
        turbo_ops.lora_add(out, x, a, bt, [0], [6], torch.tensor([0, 9], dtype=torch.int32),
                           torch.tensor([[0], [0], [2]], dtype=torch.int32))  # fmt: skip
    with pytest.raises(RuntimeError, match="LoRA A must be"):
        turbo_ops.lora_add(out, x, torch.zeros(2, 2, 7), bt, [0], [6], rows,
                           torch.tensor([[0], [0], [2]], dtype=torch.int32))  # fmt: skip


def test_lora_add_slots_is_the_cuda_pass_and_says_so_on_the_cpu(turbo_ops):
    """The per-token-slot pass (csrc/cuda/lora.cu) runs on CUDA; the CPU takes tiles."""
    x, out = torch.randn(2, 8), torch.zeros(2, 6)
    a, bt = torch.zeros(2, 2, 8), torch.zeros(2, 2, 6)
    slots = torch.tensor([0, -1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="on the CPU use lora_add"):
        turbo_ops.lora_add_slots(out, x, a, bt, [0], [6], slots)
    with pytest.raises(RuntimeError, match="lora_slots must be a contiguous int32 \\[2\\]"):
        turbo_ops.lora_add_slots(out, x, a, bt, [0], [6], slots[:1])


def test_the_cpu_step_takes_tiles_not_per_token_slots(tiny_model_dir):
    """llama_step's per-token lora_slots are the CUDA step's; on the CPU they are refused
    with the argument the CPU takes instead."""
    from llmctl_turbo.runner import TurboModelRunner

    from llmctl.engine.runner import StepBatch, stage_step
    from llmctl.model.config import ModelConfig

    model_dir = tiny_model_dir("llama3-rope")
    runner = TurboModelRunner(
        model_dir, ModelConfig.from_dir(model_dir), block_size=16, num_blocks=4
    )
    runner.load_lora_slot(0, {})  # the slots exist (zeros): the step checks its arguments
    batch = StepBatch(
        input_ids=np.array([5, 6, 7]), positions=np.arange(3), query_lens=np.array([3]),
        context_lens=np.array([3]), block_tables=[[0]], slot_mapping=np.arange(3),
        lora_slots=np.array([0]),
    )  # fmt: skip
    runner._lora_step = (None, None, torch.zeros(3, dtype=torch.int32))  # CUDA's form
    with pytest.raises(RuntimeError, match="lora_slots on CUDA and lora_rows / lora_tiles on"):
        runner.forward(stage_step(batch, runner.device), is_decode=False)
    runner._lora_step = None
    logits = runner.execute(batch)  # the CPU's own form (tiles) runs
    assert logits.shape == (1, runner.config.vocab_size) and torch.isfinite(logits).all()
