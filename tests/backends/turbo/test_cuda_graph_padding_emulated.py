"""turbo's CUDA prefill kernels (run by the test emulator on the CPU) over the padded
layout of a verification graph (``llmctl.engine.runner.GraphShape``): the real
sequences' rows equal those of the unpadded step, and the padding reads nothing.

A verification graph of bucket 4 and k = 3 holds 4 * 4 + 1 tokens of 5 sequences: a
step of 3 sequences (4, 1 and 3 tokens) leaves two padding sequences with context
length 0 that share the 9 padding tokens (``pack_step``). The cache outside the real
contexts is NaN, so any read of it would show in the real rows. The padding rows' own
output is never read (the tensor-core kernel leaves 0 / 0 there; no later op of the
step mixes rows), so it is not checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmctl.engine.runner import GraphShape, StepBatch, pack_step
from tests.backends.turbo.kernel_checks import TOLERANCE
from tests.helpers.kernel_refs import PagedCache, poisoned, ref_paged_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def emulated():
    from tests.backends.turbo.cuda_emulator import library

    try:
        return library.load()
    except library.EmulatorUnavailable as why:
        pytest.skip(str(why))


@pytest.mark.parametrize(
    "tensor_cores, dtype", [(True, torch.bfloat16), (False, torch.float32)], ids=["mma", "simt"]
)
def test_prefill_over_a_verification_graphs_padding(emulated, tensor_cores, dtype):
    block_size, heads, kv_heads, head_dim = 32, 8, 2, 64
    query_lens, context_lens = [4, 1, 3], [40, 9, 70]
    cache = PagedCache(block_size, context_lens, kv_heads, head_dim, dtype, seed=3)
    num_tokens = sum(query_lens)
    batch = StepBatch(
        input_ids=np.zeros(num_tokens, dtype=np.int32),
        positions=np.zeros(num_tokens, dtype=np.int32),
        query_lens=np.asarray(query_lens, dtype=np.int32),
        context_lens=np.asarray(context_lens, dtype=np.int32),
        block_tables=cache.tables,
        slot_mapping=np.zeros(num_tokens, dtype=np.int32),
    )
    shape = GraphShape(4, 4)
    flat, layout = pack_step(batch, pad=shape)
    inputs = layout.unpack(torch.from_numpy(flat))
    assert inputs.context_lens.tolist() == [*context_lens, 0, 0]
    # The graph's fixed table: the real rows, then stale rows (valid block ids).
    tables = torch.zeros(shape.num_seqs, inputs.block_tables.shape[1] + 1, dtype=torch.int32)
    tables[: len(query_lens), :-1] = inputs.block_tables
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(shape.num_tokens, heads, head_dim, generator=generator).to(dtype)
    out = poisoned(*q.shape, dtype=dtype)
    scale = head_dim**-0.5
    emulated.paged_prefill_attention(
        out, q, cache.k, cache.v, tables, inputs.query_start_loc.contiguous(),
        inputs.context_lens.contiguous(), scale, tensor_cores=tensor_cores,
    )  # fmt: skip
    expected = ref_paged_attention(
        q[:num_tokens], cache.k, cache.v, cache.tables, query_lens, context_lens, scale
    )
    torch.testing.assert_close(out[:num_tokens], expected, **TOLERANCE[dtype])
