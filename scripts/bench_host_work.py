"""The engine's host work at large batch: ``LLM.generate`` on many short requests beside
transformers' ``generate`` on the same prompts as one batch, in one process.

The workload of issue 14: 256 prompts of 16 tokens, 64 new tokens each, fp32, greedy,
``ignore_eos``, on stories260K (a model so small that the engine's Python work per
step, not the model, sets the pace). Every round runs transformers, then each backend,
and each backend's ratio is taken against the transformers run of its own round, so
a shared machine's drifting load touches both sides of a ratio alike; the table shows
the median over rounds. Beside wall-clock throughput it shows tokens per second of the
process's CPU time, which another program's load disturbs much less (with one torch
thread, ``OMP_NUM_THREADS=1``, it is what a quiet machine's wall clock would show).
The step profile (``llmctl bench throughput --step-profile``) of the last round says
where each backend's steps spent their time.

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
    import transformers

    from llmctl import LLM, SamplingParams
    from llmctl.bench.report import load_average_text, markdown
    from llmctl.bench.throughput import load_average
    from llmctl.bench.workload import fixed_length_prompts
    from llmctl.model.info import resolve_model

    info = resolve_model(args.model)
    prompts = fixed_length_prompts(info, args.num_prompts, args.input_len, args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    backends = args.backends.split(",")
    options = {"dtype": "float32"}
    if args.max_batch_size is not None:
        options["max_batch_size"] = args.max_batch_size
    engines = {name: LLM(args.model, backend=name, **options) for name in backends}
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32)
    batch = torch.tensor(prompts)

    def run_transformers() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
        return (out.shape[1] - batch.shape[1]) * batch.shape[0]

    runs = {"transformers": run_transformers}
    for name, llm in engines.items():
        runs[name] = lambda llm=llm: sum(len(r.token_ids) for r in llm.generate(prompts, params))
    for run in runs.values():  # warm-up: first calls pay one-off costs
        run()

    load_at_start = load_average()
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    profiles = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            engine = engines[name].engine if name in engines else None
            profiled = hasattr(engine, "step_profile")  # a local engine
            if profiled:
                engine.step_profile(reset=True)
            start, start_cpu = time.perf_counter(), time.process_time()
            produced = run()
            duration, cpu_time = time.perf_counter() - start, time.process_time() - start_cpu
            assert produced == args.num_prompts * args.output_len, f"{name} stopped early"
            wall[name].append(produced / duration)
            cpu[name].append(produced / cpu_time)
            if profiled:
                profiles[name] = engine.step_profile().report()

    print(
        f"{info.name}: {args.num_prompts} prompts of {args.input_len} tokens, "
        f"{args.output_len} new tokens each, fp32, greedy; torch threads "
        f"{torch.get_num_threads()}; median of {args.rounds} rounds\n"
    )

    def ratio(rates: dict[str, list[float]], name: str) -> str:
        return (
            f"{statistics.median(r / t for r, t in zip(rates[name], rates['transformers'])):.2f}x"
        )

    rows = [
        [
            name,
            f"{statistics.median(wall[name]):,.0f}",
            ratio(wall, name),
            f"{statistics.median(cpu[name]):,.0f}",
            ratio(cpu, name),
        ]
        for name in runs
    ]
    headers = ["engine", "output tokens/s", "vs transformers", "per CPU-second", "vs transformers"]
    print(markdown((headers, rows)))
    for name in engines:  # the spread the medians hide
        each = ", ".join(f"{r / t:.2f}x" for r, t in zip(wall[name], wall["transformers"]))
        print(f"\n{name} vs transformers, round by round: {each}")
    print(load_average_text(load_at_start, load_average()))
    if profiles:
        from llmctl.bench.report import step_profile_table
    for name, profile in profiles.items():
        print(f"\nStep profile, {name} (last round):\n")
        print(markdown(step_profile_table(profile)))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
