"""The engine's host work at large batch: ``LLM.generate`` on many short requests beside
transformers' ``generate`` on the same prompts as one batch, in one process.

The workload of issue 14: 256 prompts of 16 tokens, 64 new tokens each, fp32, greedy,
``ignore_eos``, on stories260K (a model so small that the engine's Python work per
step, not the model, sets the pace). Every round runs transformers, then each backend,
and each backend's ratio is taken against the transformers run of its own round, so
a shared machine's drifting load touches both sides of a ratio alike; the table shows
the median over rounds. The step profile (``llmctl bench throughput --step-profile``) of the
last round says where each backend's steps spent their time.

    python scripts/bench_host_work.py                      # stories260K, both backends
    python scripts/bench_host_work.py MODEL --rounds 5 --backends turbo
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "stories260K"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(DEFAULT_MODEL.resolve()))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="turbo,torch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-batch-size", type=int, default=None, help="The engines' (default: their own)."
    )
    args = parser.parse_args()

    import torch

    from llmctl import LLM, SamplingParams
    from llmctl.bench.baseline_transformers import run_transformers_baseline
    from llmctl.bench.metrics import MemoryPeak
    from llmctl.bench.report import markdown
    from llmctl.bench.workload import LengthRange, make_workload, ordinary_token_ids
    from llmctl.model_info import resolve_model

    info = resolve_model(args.model)
    token_ids = ordinary_token_ids(info.path, info.config)
    lengths = (
        LengthRange(args.input_len, args.input_len),
        LengthRange(args.output_len, args.output_len),
    )
    workload = make_workload(token_ids, args.num_prompts, *lengths, args.seed)
    warmup = make_workload(token_ids, 4, *lengths, args.seed + 1)
    prompts = [request.prompt_token_ids for request in workload.requests]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    backends = args.backends.split(",")
    options = {"dtype": "float32"}
    if args.max_batch_size is not None:
        options["max_batch_size"] = args.max_batch_size
    engines = {name: LLM(args.model, backend=name, **options) for name in backends}
    for llm in engines.values():
        llm.generate([r.prompt_token_ids for r in warmup.requests], params)

    rates: dict[str, list[float]] = {name: [] for name in ["transformers", *backends]}
    ratios: dict[str, list[float]] = {name: [] for name in backends}
    profiles = {}
    for _ in range(args.rounds):
        baseline = run_transformers_baseline(
            info.path,
            workload,
            MemoryPeak(False),
            batch_size=args.num_prompts,
            device="cpu",
            dtype="float32",
            warmup=warmup.requests[0],
        )
        rates["transformers"].append(baseline["output_tokens_per_s"])
        for name, llm in engines.items():
            profiled = hasattr(llm.engine, "step_profile")  # a local engine
            if profiled:
                llm.engine.step_profile(reset=True)
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            duration = time.perf_counter() - start
            produced = sum(len(result.token_ids) for result in results)
            assert produced == workload.output_tokens, f"{name} stopped early"
            rates[name].append(produced / duration)
            ratios[name].append(rates[name][-1] / baseline["output_tokens_per_s"])
            if profiled:
                profiles[name] = llm.engine.step_profile().report()

    print(
        f"{info.name}: {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} new tokens each, fp32, greedy; torch threads "
        f"{torch.get_num_threads()}; median of {args.rounds} rounds\n"
    )
    rows = [
        [
            name,
            f"{statistics.median(rates[name]):,.0f}",
            f"{statistics.median(ratios[name]):.2f}x" if name in ratios else "1.00x",
        ]
        for name in rates
    ]
    print(markdown((["engine", "output tokens/s", "vs transformers (same round)"], rows)))
    if profiles:
        from llmctl.bench.report import step_profile_table
    for name, profile in profiles.items():
        print(f"\nStep profile, {name} (last round):\n")
        print(markdown(step_profile_table(profile)))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
