"""Each CPU backend's decode step beside a busy neighbour, against its step alone.

    python scripts/bench_neighbour.py                  # stories260K, 16 sequences
    python scripts/bench_neighbour.py --model /tmp/llama-24m --batch 16

For each backend (turbo, torch): the median time of its model call per decode step
(``runner.execute``, ``--batch`` sequences after a 64-token prompt) measured alone, then
while another process runs a loop of 2-thread torch matmuls (started and stopped here),
then alone again. The goal: with the neighbour, at most 2.5x the time alone. Each backend
uses torch's default thread count unless ``--cpu-threads`` says otherwise. Prints one
table; the ratio's baseline is the same backend alone, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from decode_loop import BACKENDS, blocks_needed, decode_step_times, load_runner, median

import llmctl  # noqa: F401  before torch: its OpenMP wait policy (llmctl/__init__.py)

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
GOAL = 2.5
PROMPT_LEN = 64
# The neighbour: 2 threads of 1024 x 1024 fp32 matmuls, forever. It prints once it runs.
NEIGHBOUR = (
    "import torch\n"
    "torch.set_num_threads(2)\n"
    "a = torch.randn(1024, 1024)\n"
    "b = a @ a\n"
    "print('running', flush=True)\n"
    "while True:\n"
    "    b = a @ a\n"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=STORIES, help="model directory")
    parser.add_argument("--batch", type=int, default=16, help="sequences per decode step")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per measurement")
    parser.add_argument("--cpu-threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    return parser.parse_args()


def measure(runner, args: argparse.Namespace) -> float:
    """The median decode step of `runner`, in seconds."""
    return median(decode_step_times(runner, args.batch, PROMPT_LEN, args.steps))


def start_neighbour() -> subprocess.Popen:
    # A default torch process: without the passive OpenMP waits importing llmctl sets.
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    process = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR], stdout=subprocess.PIPE, text=True, env=env
    )
    if process.stdout.readline().strip() != "running":
        process.kill()
        raise SystemExit("the neighbour process did not start")
    time.sleep(0.5)  # let its threads spin up
    return process


def stop_neighbour(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=10)


def main() -> None:
    args = parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model} (pass --model DIR)")
    import torch

    threads = args.cpu_threads or torch.get_num_threads()
    rows = []
    for backend in args.backends.split(","):
        runner = load_runner(
            backend,
            args.model,
            blocks_needed(args.batch, PROMPT_LEN + args.steps),
            args.cpu_threads,
        )
        measure(runner, args)  # warm-up
        alone = measure(runner, args)
        neighbour = start_neighbour()
        try:
            beside = measure(runner, args)
        finally:
            stop_neighbour(neighbour)
        alone_after = measure(runner, args)
        baseline = min(alone, alone_after)
        rows.append((backend, alone, alone_after, beside, beside / baseline))
        del runner

    print(
        f"\nDecode step (runner.execute), {args.model.name}, {args.batch} sequences, "
        f"{threads} CPU threads; neighbour: 2-thread torch matmul loop in another process\n"
    )
    print("| backend | alone (ms) | alone again (ms) | with neighbour (ms) | ratio | goal |")
    print("|---|---|---|---|---|---|")
    for backend, alone, alone_after, beside, ratio in rows:
        verdict = "met" if ratio <= GOAL else "not met"
        print(
            f"| {backend} | {alone * 1e3:.3f} | {alone_after * 1e3:.3f} | {beside * 1e3:.3f} "
            f"| {ratio:.2f}x | <= {GOAL}x ({verdict}) |"
        )


if __name__ == "__main__":
    main()
