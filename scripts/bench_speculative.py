"""Speculative decoding (n-gram, or a draft model) against none, in the same run,
greedy, on the CPU.

Workloads (prompts from the model's own text, so they are in its distribution):
- grounded: the start of a text the model wrote, its greedy answer to that start,
  then the start again: the answer repeats the prompt's text (what prompt lookup is
  for);
- ordinary: only the start (nothing to repeat but what the model repeats of its own).
Each at batch 1 (one request at a time) and batch 16 (16 in flight). Greedy outputs
with and without speculation must be identical; the script checks it. Each figure is
the best of ``--rounds`` alternating runs; acceptance counts are summed over them.
A table at the end gives each speedup (speculation's tokens/s over none's).

    python scripts/bench_speculative.py [MODEL] [--backend turbo] [--max-tokens 128]
    python scripts/bench_speculative.py smollm2-135m --quantization gguf  # Q4_1 blocks
    python scripts/bench_speculative.py MODEL --method draft --draft SMALL_MODEL

Each row also gives the machine's load average when it ended (``os.getloadavg``): on a
shared machine the ratios move with it.
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from llmctl import LLM, SamplingParams
from llmctl.bench.throughput import load_average

STORIES = "/work/shared/models/stories260K"


def texts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """``count`` texts of ``length`` tokens the model writes from its BOS token (or from
    "The" when it has none), sampled (seeded)."""
    tokenizer = llm.engine.tokenizer
    first = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    first = first or tokenizer.encode("The")
    params = [SamplingParams(max_tokens=length, temperature=0.8, seed=i) for i in range(count)]
    outputs = [llm.generate([first], p)[0] for p in params]
    return [[*first, *o.token_ids] for o in outputs]


def timed(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    tokens = []
    for first in range(0, len(prompts), batch):
        tokens += [o.token_ids for o in llm.generate(prompts[first : first + batch], params)]
    elapsed = time.perf_counter() - started
    return tokens, sum(map(len, tokens)) / elapsed


def best_of(rounds: int, plain: LLM, spec: LLM, prompts, batch: int, max_tokens: int):
    """The best tokens/s of each over ``rounds`` alternating runs (a shared machine's
    noise only ever slows a run down)."""
    best_none = best_ngram = 0.0
    for _ in range(rounds):
        want, none_tps = timed(plain, prompts, batch, max_tokens)
        got, ngram_tps = timed(spec, prompts, batch, max_tokens)
        assert got == want, f"batch {batch}: speculation changed greedy tokens"
        best_none, best_ngram = max(best_none, none_tps), max(best_ngram, ngram_tps)
    return best_none, best_ngram


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=STORIES)
    parser.add_argument("--backend", default="turbo")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft", help="the draft model of --method draft")
    parser.add_argument(
        "--quantization", default="none", help="as the option (gguf: a GGUF file's blocks)"
    )
    args = parser.parse_args()
    if (args.method == "draft") != (args.draft is not None):
        parser.error("--draft MODEL goes with --method draft, and only with it")
    common = dict(
        backend=args.backend,
        device="cpu",
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    plain = LLM(args.model, **common)
    method = {"speculative_method": args.method}
    if args.draft:
        method["speculative_model"] = args.draft
    spec = LLM(args.model, num_speculative_tokens=args.num_speculative_tokens, **method, **common)
    starts = [text[:17] for text in texts(plain, args.num_prompts, 16)]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    answers = [o.token_ids for o in plain.generate(starts, greedy)]
    workloads = {
        # The start, the model's own answer to it, the start again: the answer is in
        # the prompt (the "repeat this with one change" case for a model this small).
        "grounded": [start + answer + start[1:] for start, answer in zip(starts, answers)],
        "ordinary": starts,
    }
    report = []
    for name, prompts in workloads.items():
        for batch in (1, 16):
            timed(plain, prompts[:2], batch, 16)  # warm up both
            timed(spec, prompts[:2], batch, 16)
            before = spec.engine.stats()
            none_tps, ngram_tps = best_of(args.rounds, plain, spec, prompts, batch, args.max_tokens)
            after = spec.engine.stats()
            proposed = after.spec_proposed - before.spec_proposed
            accepted = after.spec_accepted - before.spec_accepted
            row = {
                "workload": name,
                "batch": batch,
                "none_tokens_per_s": round(none_tps, 1),
                f"{args.method}_tokens_per_s": round(ngram_tps, 1),
                "speedup": round(ngram_tps / none_tps, 2),
                "proposed": proposed,
                "accepted": accepted,
                "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
                "load_average": load_average(),
            }
            report.append(row)
            print(json.dumps(row), flush=True)
    title = (
        f"{args.method} speculation on {args.model} ({args.backend}, {args.quantization}, greedy)"
    )
    table = Table(title=title)
    for column in ("workload", "batch", "none tok/s", f"{args.method} tok/s", "speedup"):
        table.add_column(column)
    table.add_column("accepted / proposed")
    table.add_column("load")
    for row in report:
        table.add_row(
            row["workload"],
            str(row["batch"]),
            str(row["none_tokens_per_s"]),
            str(row[f"{args.method}_tokens_per_s"]),
            f"{row['speedup']}x",
            f"{row['accepted']} / {row['proposed']} ({row['acceptance_rate']:.0%})",
            str(row["load_average"]),
        )
    Console().print(table)


if __name__ == "__main__":
    main()
