"""Where a tensor-parallel step's time goes, seen from rank 0: compute vs communication.

Runs the `llmctl bench throughput` workload through the Python API at each
``--tp`` value, in this process (rank 0; the other ranks are the processes llmctl starts),
and times every call of the engine's runner and of the torch.distributed calls it makes
(all-reduce of row-parallel outputs and embeddings, gather of the logits, broadcast of
the step's inputs). Time inside a collective includes waiting for the slowest rank.

    python scripts/tp_time_split.py /tmp/llama-24m --tp 1 2 --num-prompts 64 \
        --input-len 16:256 --output-len 16:256
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from llmctl import LLM, SamplingParams
from llmctl.bench.workload import make_workload, ordinary_token_ids, parse_length_range
from llmctl.model.info import resolve_model

TIMED = ("all_reduce", "gather", "broadcast_object_list", "barrier")


@contextmanager
def timing(totals: dict[str, list[float]]):
    """Time the distributed calls and the runner's ``execute`` into ``totals``."""
    originals = {name: getattr(dist, name) for name in TIMED}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = totals[name]
                entry[0] += time.perf_counter() - start
                entry[1] += 1

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, timed(name, fn))
    try:
        yield timed
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def run(model: str, tp: int, prompts, output_lens) -> dict[str, list[float]]:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    with timing(totals) as timed:
        llm = LLM(model, backend="torch", device="cpu", tensor_parallel_size=tp)
        runner = llm.engine.engine.runner
        runner.execute = timed("execute", runner.execute)
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        totals.clear()
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in output_lens]
        start = time.perf_counter()
        llm.generate(prompts, params)
        totals["wall"] = [time.perf_counter() - start, 1]
        llm.shutdown()
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="16:256")
    parser.add_argument("--output-len", default="16:256")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    info = resolve_model(args.model)
    workload = make_workload(
        ordinary_token_ids(Path(info.path), info.config),
        args.num_prompts,
        parse_length_range(args.input_len, "--input-len"),
        parse_length_range(args.output_len, "--output-len"),
        args.seed,
    )
    prompts = [r.prompt_token_ids for r in workload.requests]
    output_lens = [r.output_len for r in workload.requests]
    rows = {tp: run(args.model, tp, prompts, output_lens) for tp in args.tp}
    print(f"{workload.output_tokens} output tokens; seconds (calls) on rank 0")
    names = ["wall", "execute", *TIMED]
    print("| tp | tok/s | " + " | ".join(names) + " | execute minus communication |")
    print("|---" * (len(names) + 3) + "|")
    for tp, totals in rows.items():
        wall = totals["wall"][0]
        cells = [f"{totals[n][0]:.2f} ({totals[n][1]})" for n in names]
        communication = sum(totals[n][0] for n in TIMED)
        compute = totals["execute"][0] - communication
        print(
            f"| {tp} | {workload.output_tokens / wall:.0f} | "
            + " | ".join(cells)
            + f" | {compute:.2f} |"
        )


if __name__ == "__main__":
    main()
