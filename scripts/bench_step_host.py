"""The engine's host work per sequence per step, in the engine thread's CPU time.

``llmctl bench throughput --step-profile`` times each phase by the wall clock, which a
shared machine's load inflates by whole time slices. This runs the same kind of
workload through ``LLM.generate`` with the step profile's clock replaced by
``time.thread_time`` (the engine thread's CPU time), so the host phases show what the
engine's own work costs even while other programs run; the model call is left out of
the figures that matter (its threads are turbo's or OpenMP's, not the engine thread).

    python scripts/bench_step_host.py                 # stories260K, turbo, 128 x 16 -> 128
    python scripts/bench_step_host.py --backend torch --rounds 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import llmctl  # noqa: F401  before torch: its OpenMP wait policy (llmctl/__init__.py)

STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"
HOST_PHASES = ("schedule", "inputs", "sample", "outputs", "deliver")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(STORIES))
    parser.add_argument("--backend", default="turbo")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from llmctl import LLM, SamplingParams
    from llmctl.bench.workload import fixed_length_prompts
    from llmctl.engine import async_engine, llm_engine
    from llmctl.model.info import resolve_model

    info = resolve_model(args.model)
    prompts = fixed_length_prompts(info, args.num_prompts, args.input_len, seed=0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm = LLM(args.model, backend=args.backend, dtype="float32")
    llm.generate(prompts, params)  # warm-up
    llm_engine.perf_counter = async_engine.perf_counter = time.thread_time
    print(f"{info.name}, {args.backend}: µs per sequence per step, engine-thread CPU time")
    print("| round | " + " | ".join(HOST_PHASES) + " | host work | host share |")
    print("|---" * (len(HOST_PHASES) + 3) + "|")
    for round_ in range(1, args.rounds + 1):
        llm.engine.step_profile(reset=True)
        llm.generate(prompts, params)
        report = llm.engine.step_profile().report()
        cells = [f"{report['seq_us'][phase]:.2f}" for phase in HOST_PHASES]
        print(
            f"| {round_} | " + " | ".join(cells) + f" | {report['host_seq_us']:.2f} | "
            f"{report['host_share'] * 100:.1f} % |"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
