"""The block-size sweep: one throughput run (and optionally one serve run) per
``cache_block_seq_len`` value, then a table and a chart of throughput, first-token
latency and KV memory against block size.

Each value gets a fresh engine in this process; serve runs start a fresh
``llmctl serve`` subprocess. Every run sees the same seeded workload.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.bench.serve_load import run_serve_load, served_model_name
from llmctl.bench.server_process import llmctl_server
from llmctl.bench.throughput import WorkloadSpec, benchmark_throughput, workload_for
from llmctl.errors import OptionError

if TYPE_CHECKING:
    from rich.progress import Progress


def parse_block_sizes(text: str) -> list[int]:
    """``"16,32,64"`` -> ``[16, 32, 64]``; each a positive integer, no repeats."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes) or len(set(sizes)) != len(sizes):
        raise OptionError(
            f"--cache-block-seq-len {text!r}: give distinct positive block sizes separated "
            "by commas, e.g. 16,32,64,128"
        )
    return sizes


def run_sweep(
    model: str | None,
    flags: Mapping[str, Any],
    block_sizes: list[int],
    spec: WorkloadSpec,
    *,
    profile: str | None = None,
    serve_concurrency: int | None = None,
    serve_request_rate: float | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Benchmark every block size; with a serve concurrency or rate, serve runs too."""
    from llmctl.model.info import resolve_model

    serve = serve_concurrency is not None or serve_request_rate is not None
    runs = []
    for block_size in block_sizes:
        run_flags = {**flags, "cache_block_seq_len": block_size}
        throughput = benchmark_throughput(
            model, run_flags, spec, profile=profile, progress=progress
        )
        run: dict[str, Any] = {"block_size": block_size, "throughput": throughput, "serve": None}
        if serve:
            model_arg = throughput["model"]
            workload = workload_for(resolve_model(model_arg), spec)
            with llmctl_server(model_arg, run_flags, profile=profile) as url:
                run["serve"] = asyncio.run(
                    _serve(url, workload, serve_concurrency, serve_request_rate, progress)
                )
        runs.append(run)
    first = runs[0]["throughput"]
    return {
        "kind": "sweep",
        "model": first["model"],
        "backend": first["backend"],
        "device": first["device"],
        "workload": first["workload"],
        "serve_load": {"concurrency": serve_concurrency, "request_rate": serve_request_rate}
        if serve
        else None,
        "runs": runs,
    }


async def _serve(
    url: str,
    workload: Any,
    concurrency: int | None,
    request_rate: float | None,
    progress: Progress | None,
) -> dict[str, Any]:
    task = progress.add_task("serve: requests", total=len(workload.requests)) if progress else None
    return await run_serve_load(
        url,
        await served_model_name(url, None),
        workload,
        concurrency=concurrency,
        request_rate=request_rate,
        on_done=lambda: progress.advance(task) if progress else None,
    )


def write_chart(report: dict[str, Any], path: Path) -> None:
    """A PNG with three panels against block size: output tokens/s, first-token latency
    (p50; from the serve runs when there are any, else from the offline runs) and the
    peak KV-cache memory in use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    sizes = [run["block_size"] for run in runs]
    has_serve = all(run["serve"] is not None for run in runs)
    fig, (tps_ax, ttft_ax, kv_ax) = plt.subplots(1, 3, figsize=(15, 4.5))
    model_name = report["model"].rstrip("/").split("/")[-1]  # a path's last part
    fig.suptitle(
        f"{model_name} on {report['backend']} ({report['device']}): "
        f"{report['workload']['num_prompts']} requests"
    )

    tps_ax.plot(
        sizes,
        [r["throughput"]["engine"]["output_tokens_per_s"] for r in runs],
        "o-",
        label="offline",
    )
    if has_serve:
        tps_ax.plot(sizes, [r["serve"]["output_tokens_per_s"] for r in runs], "s--", label="serve")
    tps_ax.set(title="Throughput", ylabel="output tokens/s")
    tps_ax.legend()

    source = "serve" if has_serve else "offline"
    ttft = [
        (r["serve"]["ttft_ms"] if has_serve else r["throughput"]["engine"]["ttft_ms"])["p50"]
        for r in runs
    ]
    ttft_ax.plot(sizes, ttft, "o-", color="tab:orange")
    ttft_ax.set(title=f"First-token latency ({source}, p50)", ylabel="ms")

    kv_mib = [r["throughput"]["engine"]["peak_kv_cache_bytes"] / 2**20 for r in runs]
    kv_ax.plot(sizes, kv_mib, "o-", color="tab:green")
    kv_ax.set(title="Peak KV cache in use", ylabel="MiB")

    for ax in (tps_ax, ttft_ax, kv_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("cache_block_seq_len (tokens per block)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
