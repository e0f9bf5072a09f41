"""Soak a live ``llmctl serve``: mixed traffic for minutes, answers checked, leaks watched.

    python scripts/soak.py                                  # 10 min, 32 clients, stories260K
    python scripts/soak.py --minutes 1 --concurrency 8
    python scripts/soak.py --url http://127.0.0.1:8000 --api-key KEY

Without ``--url`` it starts ``llmctl serve`` on ``--model`` (torch backend, one thread).
See ``llmctl/bench/soak.py`` for what is sent and checked. It prints a Markdown table
and writes the full report as JSON with ``--output``. Exit status 1 when the run fails
its goals: any 5xx, a greedy answer that differs from the sequential reference, KV
blocks still in use when idle, or RSS growing 10 % or more after the first minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

from llmctl.bench.soak import SoakSettings, report_markdown, run_soak

DEFAULT_MODEL = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"
MAX_RSS_GROWTH = 0.10


def failures(report: dict) -> list[str]:
    problems = []
    if report["server_errors"]:
        problems.append(f"{report['server_errors']} answers with a 5xx")
    if report["greedy_mismatches"]:
        problems.append(f"{report['greedy_mismatches']} greedy answers differ")
    if report["kv_blocks_used_when_idle"] != 0:
        problems.append(f"{report['kv_blocks_used_when_idle']:.0f} KV blocks in use when idle")
    growth = report["rss_growth_after_first_minute"]
    if growth is not None and growth >= MAX_RSS_GROWTH:
        problems.append(f"RSS grew {growth:.1%} after the first minute")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="A running server (else one is started on --model).")
    parser.add_argument("--api-key")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--disconnect-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="Write the JSON report here.")
    args = parser.parse_args()
    settings = SoakSettings(
        duration_s=args.minutes * 60,
        concurrency=args.concurrency,
        disconnect_share=args.disconnect_share,
        seed=args.seed,
    )
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from llmctl.bench.server_process import llmctl_server

            os.environ.setdefault("OMP_NUM_THREADS", "1")
            url = stack.enter_context(llmctl_server(str(args.model), {"backend": "torch"}))
        report = asyncio.run(run_soak(url, settings, api_key=args.api_key))
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(report_markdown(report))
    problems = failures(report)
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
