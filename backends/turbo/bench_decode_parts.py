"""A CPU decode step's two halves on the 24M Llama, each against what the machine gives.

    python backends/turbo/bench_decode_parts.py
    python backends/turbo/bench_decode_parts.py --rows 8,16,32,64 --batches 8x450,64x300

1. Products: every layer's qkv, o_proj, gate/up (with its activation) and down, each
   layer with its own weights so that the step streams them from memory as a real one
   does, for each row count (the decode batch): turbo's packed kernels against
   ``torch.mm`` on the same inputs. GFLOP/s and the ratio.
2. Attention: ``paged_decode_attention`` over every layer's fp32 K/V cache (8 query and
   4 KV heads of 64, blocks of 64, the sequences' blocks interleaved as the engine
   allocates them while they grow), for each batch of sequences x context, against
   ``torch.sum`` over the same caches: the rate at which this machine streams those
   bytes, the bound of an attention that must read them all.

Each figure is the median of ``--repeats`` calls, the two sides alternating round by round.
"""

from __future__ import annotations

import argparse

import torch
from bench_cpu_kernels import MATRICES, kernels, median_seconds  # this folder is on sys.path
from llmctl_turbo.build import load_ops

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 4, 64, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,32,64", help="decode batches of the products")
    parser.add_argument(
        "--batches",
        default="8x450,28x400,64x300,64x100",
        help="sequences x context of the attention, comma-separated",
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def best_of(rounds: int, repeats: int, *fns) -> list[float]:
    """Each fn's best median over ``rounds`` rounds, the fns alternating."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()  # warm-up
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], median_seconds(fn, repeats))
    return best


def product_calls(ops, layers: list, rows: int, generator: torch.Generator):
    """(torch.mm's, turbo's) products of every layer for ``rows`` rows of inputs: each
    matrix's pair from ``bench_cpu_kernels.kernels``."""
    x = {w.shape[1]: torch.randn(rows, w.shape[1], generator=generator) for w, _ in layers[0]}
    calls = [kernels(ops, w, x[w.shape[1]], fused)[:2] for layer in layers for w, fused in layer]

    def aten() -> None:
        for aten_call, _ in calls:
            aten_call()

    def turbo() -> None:
        for _, turbo_call in calls:
            turbo_call()

    return aten, turbo


def products(ops, rows_list: list[int], rounds: int, repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    layers = [
        [
            (torch.randn(out_features, in_features, generator=generator) / 16, fused)
            for out_features, in_features, fused in MATRICES.values()
        ]
        for _ in range(LAYERS)
    ]
    weights = sum(w.numel() for layer in layers for w, _ in layer)
    print(f"\n{LAYERS} layers' products: {weights * 4 / 1e6:.0f} MB of fp32 weights a step")
    print("\n| rows | torch.mm GFLOP/s | turbo GFLOP/s | turbo / torch.mm |\n|---|---|---|---|")
    for rows in rows_list:
        aten_s, turbo_s = best_of(rounds, repeats, *product_calls(ops, layers, rows, generator))
        flops = 2 * weights * rows
        print(
            f"| {rows} | {flops / aten_s / 1e9:.0f} | {flops / turbo_s / 1e9:.0f} "
            f"| {aten_s / turbo_s:.2f}x |"
        )


def attention_calls(ops, seqs: int, context: int, generator: torch.Generator):
    """(turbo's attention, torch.sum) over every layer's cache of ``seqs`` sequences at
    ``context`` tokens, and the bytes each reads."""
    per_seq = -(-context // BLOCK)
    # Block j of sequence i is block j * seqs + i: sequences that grow together.
    tables = torch.tensor(
        [[j * seqs + i for j in range(per_seq)] for i in range(seqs)], dtype=torch.int32
    )
    lens = torch.full((seqs,), context, dtype=torch.int32)
    shape = (seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(LAYERS)
    ]
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=generator)
    out = torch.empty_like(q)

    def attend() -> None:
        for k, v in caches:
            ops.paged_decode_attention(out, q, k, v, tables, lens, HEAD_DIM**-0.5)

    def stream() -> None:
        for k, v in caches:
            k.sum(), v.sum()

    needed = LAYERS * 2 * seqs * context * KV_HEADS * HEAD_DIM * 4  # what attention reads
    held = sum(k.numel() + v.numel() for k, v in caches) * 4  # what the sum reads
    return attend, stream, needed, held


def attention(ops, batches: list[tuple[int, int]], rounds: int, repeats: int) -> None:
    print(
        f"\n{LAYERS} layers' decode attention, fp32 cache, {HEADS} query / {KV_HEADS} KV heads "
        f"of {HEAD_DIM}, blocks of {BLOCK}\n"
    )
    print(
        "| sequences x context | K/V MB | attention GB/s | torch.sum GB/s | attention / sum |\n"
        "|---|---|---|---|---|"
    )
    generator = torch.Generator().manual_seed(1)
    for seqs, context in batches:
        attend, stream, needed, held = attention_calls(ops, seqs, context, generator)
        attend_s, stream_s = best_of(rounds, repeats, attend, stream)
        print(
            f"| {seqs} x {context} | {needed / 1e6:.0f} | {needed / attend_s / 1e9:.1f} "
            f"| {held / stream_s / 1e9:.1f} | {needed / attend_s / (held / stream_s):.2f} |"
        )


def main() -> None:
    args = parse_args()
    ops = load_ops()
    print(f"fp32, {torch.get_num_threads()} threads, turbo's kernels on {ops.cpu_isa()}")
    products(ops, [int(r) for r in args.rows.split(",")], args.rounds, args.repeats)
    batches = [tuple(map(int, b.split("x"))) for b in args.batches.split(",")]
    attention(ops, batches, args.rounds, args.repeats)


if __name__ == "__main__":
    main()
