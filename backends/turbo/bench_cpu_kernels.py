"""turbo's CPU linear kernels against ATen's matmul, on the 24M Llama's shapes.

    python backends/turbo/bench_cpu_kernels.py                # torch's thread count
    python backends/turbo/bench_cpu_kernels.py --threads 1 --rows 1,16,64,512
    python backends/turbo/bench_cpu_kernels.py --isa avx512vnni --rows 256,1024,4096

For each weight matrix of a layer (hidden 512, intermediate 1408) and each row count (1
is batch-1 decode, 16-64 a decode batch, 512 a prefill chunk): turbo's packed-panel
kernel (``linear``; the MLP's gate/up with its activation, ``linear_silu_mul``) and
ATen's ``torch.mm`` (plus ``silu * up`` for gate/up) on the same fp32 inputs, and turbo's
kernel on the same weight quantized to int8 (``quantization=int8``), measured in
alternation in this process, each the median of ``--repeats`` calls. Prints GFLOP/s,
the fp32 weight bytes streamed per second and the ratios turbo / ATen and turbo's
int8 / fp32.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from llmctl_turbo.build import load_ops
from llmctl_turbo.runner import pack_int8_linear

HIDDEN, INTERMEDIATE = 512, 1408
# name: (out_features, in_features, gate/up fused)
MATRICES = {
    "qkv": (1024, HIDDEN, False),
    "o_proj": (HIDDEN, HIDDEN, False),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, True),
    "down": (HIDDEN, INTERMEDIATE, False),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,4,16,64,512", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--isa",
        help="turbo's instruction set (avx512vnni, avx512, avx2, portable; default: the best)",
    )
    return parser.parse_args()


def kernels(ops, weight: torch.Tensor, x: torch.Tensor, fused: bool):
    """(ATen's, turbo's fp32, turbo's int8) computation of the same layer output for x."""
    groups = 2 if fused else 1
    packed = ops.pack_linear_weight(weight, groups)
    packed_int8, scale = pack_int8_linear(weight, groups)
    if fused:
        out = torch.empty(x.shape[0], weight.shape[0] // 2)

        def aten():
            gate, up = torch.mm(x, weight.t()).chunk(2, dim=-1)
            return F.silu(gate) * up

        return (
            aten,
            lambda: ops.linear_silu_mul(out, x, packed),
            lambda: ops.linear_silu_mul(out, x, packed_int8, scale),
        )
    out, none = torch.empty(x.shape[0], weight.shape[0]), torch.empty(0)
    return (
        lambda: torch.mm(x, weight.t()),
        lambda: ops.linear(out, x, packed, none),
        lambda: ops.linear(out, x, packed_int8, none, scale),
    )


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    args = parse_args()
    ops = load_ops()
    if args.isa:
        try:
            ops.set_cpu_isa(args.isa)
        except RuntimeError as exc:  # unknown, or one this CPU lacks: say which are there
            raise SystemExit(f"--isa {args.isa}: {str(exc).splitlines()[0]}") from None
    torch.set_num_threads(args.threads)
    ops.set_cpu_threads(args.threads)
    print(
        f"\nfp32, {args.threads} threads, turbo's kernels on {ops.cpu_isa()}; "
        f"median of {args.repeats} calls each, alternating\n"
    )
    print(
        "| matrix | rows | ATen GFLOP/s | turbo GFLOP/s | turbo GB/s of weights | turbo / ATen "
        "| turbo int8 GFLOP/s | int8 / fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for name, (out_features, in_features, fused) in MATRICES.items():
        weight = torch.randn(out_features, in_features, generator=generator) / 16
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=generator)
            aten, turbo, int8 = kernels(ops, weight, x, fused)
            aten(), turbo(), int8()  # warm-up
            aten_s = turbo_s = int8_s = float("inf")
            for _ in range(3):
                aten_s = min(aten_s, median_seconds(aten, args.repeats))
                turbo_s = min(turbo_s, median_seconds(turbo, args.repeats))
                int8_s = min(int8_s, median_seconds(int8, args.repeats))
            flops = 2 * rows * out_features * in_features
            weight_bytes = weight.numel() * weight.element_size()
            print(
                f"| {name} [{out_features}, {in_features}] | {rows} | {flops / aten_s / 1e9:.1f} "
                f"| {flops / turbo_s / 1e9:.1f} | {weight_bytes / turbo_s / 1e9:.1f} "
                f"| {aten_s / turbo_s:.2f}x | {flops / int8_s / 1e9:.1f} | {turbo_s / int8_s:.2f}x |"
            )


if __name__ == "__main__":
    main()
