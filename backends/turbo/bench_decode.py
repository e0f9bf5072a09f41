"""Decode speed of the turbo backend beside the torch backend, in the same process.

    python backends/turbo/bench_decode.py                 # both goal scenarios
    python backends/turbo/bench_decode.py --rounds 5 --new-tokens 128

Scenarios (the goals of the turbo issue):
- stories260K at batch 1: turbo should be at least 2x the torch backend;
- a random ~24M-parameter Llama (hidden 512, intermediate 1408, 8 layers, 8 heads,
  4 KV heads, vocabulary 512) at batch 16: turbo at least equal.

Both engines are open at once and measured in alternation, round after round, so a
busy machine slows both alike; each backend's best round is reported. Tokens/s counts
every generated token of the batch over the wall time of ``generate`` (the prompt,
"Once upon a time", is a few tokens, so this is decode speed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
BACKENDS = ("torch", "turbo")


@dataclass(frozen=True)
class Scenario:
    name: str
    model_dir: Path
    batch: int
    goal_ratio: float  # turbo / torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per backend")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--block-size", type=int, default=64, help="cache_block_seq_len")
    return parser.parse_args()


def make_24m_llama(directory: Path) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    from make_random_llama import make_random_llama

    make_random_llama(directory)
    return directory


def tokens_per_second(llm, batch: int, new_tokens: int) -> float:
    from llmctl import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(["Once upon a time"] * batch, params)
    elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outputs) / elapsed


def run_scenario(scenario: Scenario, args: argparse.Namespace) -> dict[str, float]:
    from llmctl import LLM, SamplingParams

    engines = {
        name: LLM(
            str(scenario.model_dir),
            backend=name,
            device="cpu",
            dtype="float32",
            cache_block_seq_len=args.block_size,
        )
        for name in BACKENDS
    }
    try:
        warm_up = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for llm in engines.values():
            llm.generate(["Once upon a time"] * scenario.batch, warm_up)
        best = dict.fromkeys(BACKENDS, 0.0)
        for _ in range(args.rounds):
            for name, llm in engines.items():
                speed = tokens_per_second(llm, scenario.batch, args.new_tokens)
                best[name] = max(best[name], speed)
        return best
    finally:
        for llm in engines.values():
            llm.shutdown()


def main() -> int:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if not (STORIES / "config.json").is_file():
        print(f"stories260K not found at {STORIES} (it lives in ../shared/)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        scenarios = [
            Scenario("stories260K, batch 1", STORIES, batch=1, goal_ratio=2.0),
            Scenario("random Llama 24M, batch 16", make_24m_llama(Path(tmp)), 16, 1.0),
        ]
        print(
            f"fp32, {args.threads} threads, block size {args.block_size}, "
            f"{args.new_tokens} new tokens per sequence, best of {args.rounds} rounds\n"
        )
        header = f"{'scenario':<28} {'torch tok/s':>12} {'turbo tok/s':>12} {'ratio':>7}  goal"
        print(header)
        print("-" * len(header))
        all_met = True
        for scenario in scenarios:
            speeds = run_scenario(scenario, args)
            ratio = speeds["turbo"] / speeds["torch"]
            met = ratio >= scenario.goal_ratio
            all_met &= met
            print(
                f"{scenario.name:<28} {speeds['torch']:>12.0f} {speeds['turbo']:>12.0f} "
                f"{ratio:>6.2f}x  >= {scenario.goal_ratio:g}x {'met' if met else 'NOT MET'}",
                flush=True,
            )
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
