"""turbo's CUDA LoRA kernels (csrc/cuda/lora.cu: shrink, then expand into a linear's
output), run on the CPU by the test emulator, against plain torch in float64 on fresh
random inputs.

Covers what the step feeds them: 1-20 and 64 token rows (partial and whole tiles of 8),
ranks 2, 8 and 16, slots mixed per row (base rows, runs of one slot as a prompt chunk
gives, every slot in one tile), one output part or the fused q/k/v and gate/up parts at
their offsets in a wider (strided) output, input and output widths that are not
multiples of a warp or of a block's 128 columns, and fp32 / bf16 / fp16 activations.
Rows without an adapter, and columns outside the parts, must be left bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.turbo.kernel_checks import (
    DTYPES,
    LORA_PARTS,
    LORA_ROWS,
    MAX_LORAS,
    check_lora_add,
)
from tests.helpers.kernel_refs import int32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("parts", LORA_PARTS, ids=lambda p: p[0])
@pytest.mark.parametrize("rank", [2, 8, 16])
def test_lora_add_matches_plain_torch(emulated, dtype, parts, rank):
    in_features = {2: 67, 8: 200, 16: 33}[rank]  # never a multiple of the warp's 32
    for rows in LORA_ROWS:
        check_lora_add(emulated.lora_add, dtype, rows, rank, parts, in_features, seed=rows * rank)


def test_every_slot_in_one_tile_and_all_base_rows(emulated):
    """A tile of 8 rows over all four slots and the base (each slot read once per group),
    and a step where no row has an adapter (nothing may change)."""
    mixed = int32([3, 0, -1, 3, 1, 2, 0, -1, 1, 1])
    check_lora_add(emulated.lora_add, torch.bfloat16, 10, 8, LORA_PARTS[1], 96, seed=1, slots=mixed)
    check_lora_add(
        emulated.lora_add, torch.float32, 9, 8, LORA_PARTS[0], 96, seed=2, slots=int32([-1] * 9)
    )


def test_rank_above_a_warp(emulated):
    """Ranks are loops, not register arrays: 64 works as 16 does."""
    check_lora_add(emulated.lora_add, torch.float32, 11, 64, LORA_PARTS[2], 130, seed=3)


def test_slot_outside_the_slots_traps(emulated):
    """A slot past the last is a launch failure, never a read of another tensor's memory."""
    x, out = torch.randn(3, 16), torch.zeros(3, 8)
    a, bt = torch.zeros(MAX_LORAS, 2, 16), torch.zeros(MAX_LORAS, 2, 8)
    with pytest.raises(RuntimeError, match="__trap"):
        emulated.lora_add(out, x, a, bt, [0], [8], int32([0, MAX_LORAS, -1]))


def test_more_parts_than_the_kernel_takes_is_an_error(emulated):
    x, out = torch.randn(2, 16), torch.zeros(2, 8)
    a, bt = torch.zeros(1, 8, 16), torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="lora_expand failed"):
        emulated.lora_add(out, x, a, bt, [0, 2, 4, 6], [2, 2, 2, 2], int32([0, 0]))
