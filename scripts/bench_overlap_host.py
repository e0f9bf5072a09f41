"""The host work of overlapped steps (the GPU's way), measured on the CPU beside the plain
step loop's, in one process.

On a GPU the engine's steps overlap: while the device runs step N, the host prepares
step N+1 and turns step N-1's tokens into outputs (``LLMEngine``). With CUDA graphs a
small model's decode step takes about a millisecond, so at a large batch that host work
sets the pace. The same loop runs on the CPU (``LLMEngine(overlap=True)``: the same
bookkeeping, only nothing computes behind the host's back), which is how this measures
it where no GPU is: two engines over one runner, one plain and one overlapped, take turns
on the same requests (greedy, ``ignore_eos``, outputs at the end as ``LLM.generate``
asks). The table shows each loop's host work in µs per sequence per step, by phase
(medians over rounds), and the ratio of the two. Both must give the same tokens.

    python scripts/bench_overlap_host.py                    # stories260K, turbo, 128 x 256
    python scripts/bench_overlap_host.py MODEL --backend torch --num-prompts 256 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path
from time import perf_counter

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "stories260K"
PHASES = ("schedule", "inputs", "sample", "outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(DEFAULT_MODEL.resolve()))
    parser.add_argument("--backend", default="turbo")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from llmctl import LLM
    from llmctl.api import WHOLE_ANSWER
    from llmctl.bench.workload import fixed_length_prompts
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.engine.sampling_params import SamplingParams
    from llmctl.engine.step_profile import StepProfile
    from llmctl.model.info import resolve_model

    info = resolve_model(args.model)
    prompts = fixed_length_prompts(info, args.num_prompts, args.input_len, args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm = LLM(args.model, backend=args.backend, dtype="float32")
    loaded = llm.engine.engine  # the LLMEngine the LLM's async engine drives

    def engine(overlap: bool) -> LLMEngine:
        # Both engines write the one runner's cache in turn: no prefix caching, or one
        # would find blocks it keyed that the other has overwritten since.
        config = replace(loaded.scheduler.config, enable_prefix_caching=False)
        return LLMEngine(
            loaded.runner,
            loaded.tokenizer,
            config,
            max_model_len=loaded.max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            vocab_size=loaded.vocab_size,
            overlap=overlap,
        )

    def run(engine: LLMEngine) -> tuple[float, dict, dict[str, list[int]]]:
        engine.profile = StepProfile()
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, params, stream_interval=WHOLE_ANSWER)
        tokens: dict[str, list[int]] = {}
        started = perf_counter()
        while engine.has_unfinished():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        return perf_counter() - started, engine.profile.report(), tokens

    loops = {"plain": engine(False), "overlapped": engine(True)}
    results: dict[str, list[tuple[float, dict]]] = {name: [] for name in loops}
    expected = None
    for _ in range(args.rounds):
        for name, each in loops.items():
            seconds, report, tokens = run(each)
            expected = expected or tokens
            if tokens != expected:
                raise SystemExit(f"the {name} loop gave other tokens than the plain one")
            results[name].append((seconds, report))
    llm.shutdown()

    print(
        f"\n{args.num_prompts} prompts x {args.input_len} -> {args.output_len} tokens, "
        f"{info.name} on {args.backend}, {args.rounds} rounds (medians)\n"
    )
    print(
        "| loop | host µs / sequence / step | "
        + " | ".join(PHASES)
        + " | host share | wall s |\n|---|---|"
        + "---|" * (len(PHASES) + 2)
    )
    host = {}
    for name, runs in results.items():
        host[name] = statistics.median(report["host_seq_us"] for _, report in runs)
        phases = " | ".join(
            f"{statistics.median(report['seq_us'][phase] for _, report in runs):.2f}"
            for phase in PHASES
        )
        share = statistics.median(report["host_share"] for _, report in runs)
        wall = statistics.median(seconds for seconds, _ in runs)
        print(f"| {name} | {host[name]:.2f} | {phases} | {share:.1%} | {wall:.2f} |")
    print(f"\noverlapped / plain host work: {host['overlapped'] / host['plain']:.2f}x")


if __name__ == "__main__":
    main()
