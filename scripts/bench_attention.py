"""turbo's CPU paged attention against torch's scaled_dot_product_attention, in the same
process, on SmolLM2's heads (9 query heads, 3 kv heads, head_dim 64) or others
(``--heads 8,4,8``: stories260K's, which turbo's narrow decode kernel takes).

Cases: decode (1 query row per sequence), verification (the 5 rows a speculative step
with 4 proposals feeds), and prefill (every row of a prompt, causally). Each case runs
over ``--layers`` separate caches, as a model step does, so the keys and values come from
memory rather than from the cache of the layer before. torch gets each sequence's keys
and values contiguous, already expanded to every query head (that copy is not timed),
and a causal mask aligned to the end of the context; turbo reads them from shuffled
blocks of its paged cache. Outputs are checked against torch's first. The ratio is
torch's time over turbo's (above 1: turbo is faster).

    python scripts/bench_attention.py [--heads 9,3,64] [--block-size 64] [--layers 30]
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F
from llmctl_turbo.build import load_ops
from rich.console import Console
from rich.table import Table

# (name, sequences, query rows per sequence, context length per sequence)
CASES = [
    ("decode", 1, 1, 160),
    ("decode", 1, 1, 2048),
    ("decode", 16, 1, 160),
    ("decode", 256, 1, 48),
    ("verify 5 rows", 1, 5, 160),
    ("verify 5 rows", 1, 5, 2048),
    ("verify 5 rows", 16, 5, 160),
    ("prefill", 1, 512, 512),
    ("prefill", 1, 1024, 1024),
]


class Case:
    """One case's inputs for ``layers`` layers: a paged cache and torch's view of it."""

    def __init__(
        self,
        heads: tuple[int, int, int],
        seqs: int,
        rows: int,
        context: int,
        block_size: int,
        layers: int,
    ):
        self.heads, self.kv_heads, self.head_dim = heads
        self.context = context
        per_seq = -(-context // block_size)
        num_blocks = seqs * per_seq
        order = torch.randperm(num_blocks, dtype=torch.int32)  # blocks out of order
        self.tables = order.view(seqs, per_seq).contiguous()
        self.query_start_loc = torch.arange(0, (seqs + 1) * rows, rows, dtype=torch.int32)
        self.context_lens = torch.full((seqs,), context, dtype=torch.int32)
        shape = (num_blocks, block_size, self.kv_heads, self.head_dim)
        self.k = [torch.randn(shape) for _ in range(layers)]
        self.v = [torch.randn(shape) for _ in range(layers)]
        self.q = torch.randn(seqs * rows, self.heads, self.head_dim)
        # torch's inputs: [seqs, heads, context, head_dim], keys in position order.
        flat = self.tables.reshape(-1).long()
        self.k_dense = [self._dense(k, flat, seqs) for k in self.k]
        self.v_dense = [self._dense(v, flat, seqs) for v in self.v]
        self.q_dense = self.q.view(seqs, rows, self.heads, -1).transpose(1, 2).contiguous()
        # Row i of a sequence sits at position context - rows + i: it sees keys up to it.
        positions = torch.arange(context - rows, context)
        self.mask = torch.arange(context)[None, :] <= positions[:, None]

    def _dense(self, cache: torch.Tensor, flat: torch.Tensor, seqs: int) -> torch.Tensor:
        rows = cache[flat].view(seqs, -1, self.kv_heads, self.head_dim)[:, : self.context]
        group = self.heads // self.kv_heads
        return rows.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()


def run_turbo(ops, case: Case, out: torch.Tensor, layer: int) -> None:
    ops.paged_prefill_attention(
        out,
        case.q,
        case.k[layer],
        case.v[layer],
        case.tables,
        case.query_start_loc,
        case.context_lens,
        case.head_dim**-0.5,
    )


def run_torch(case: Case, layer: int) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        case.q_dense, case.k_dense[layer], case.v_dense[layer], attn_mask=case.mask
    )


def best_ms(fn, layers: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--heads", default="9,3,64", help="query heads, kv heads, head_dim (default SmolLM2's)"
    )
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    heads = tuple(int(n) for n in args.heads.split(","))
    torch.manual_seed(0)
    ops = load_ops()
    table = Table(
        title=f"CPU paged attention, heads {args.heads}, {args.layers} layers, block size "
        f"{args.block_size} ({torch.get_num_threads()} threads)"
    )
    for column in ("case", "seqs x rows", "context", "turbo ms", "torch ms", "torch / turbo"):
        table.add_column(column)
    for name, seqs, rows, context in CASES:
        case = Case(heads, seqs, rows, context, args.block_size, args.layers)
        out = torch.empty_like(case.q)
        run_turbo(ops, case, out, 0)
        want = run_torch(case, 0).transpose(1, 2).reshape_as(out)
        torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)
        turbo = best_ms(partial(run_turbo, ops, case, out), args.layers, args.rounds)
        baseline = best_ms(partial(run_torch, case), args.layers, args.rounds)
        table.add_row(
            name,
            f"{seqs} x {rows}",
            str(context),
            f"{turbo:.2f}",
            f"{baseline:.2f}",
            f"{baseline / turbo:.2f}x",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
