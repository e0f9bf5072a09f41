"""Benchmark reports as tables (terminal or markdown) and JSON files.

Each ``*_table`` function turns a report dict into ``(headers, rows)`` of strings, which
``markdown`` and ``rich_table`` render; the JSON file is the report dict itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

Rows = tuple[list[str], list[list[str]]]


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _pct(summary: dict[str, float] | None, key: str) -> str:
    return "-" if summary is None else _num(summary[key])


def throughput_table(report: dict[str, Any]) -> Rows:
    """Metric rows; one column for the engine and one for the baseline if it ran."""
    engine, baseline = report["engine"], report["baseline"]
    headers = ["metric", f"llmctl ({report['backend']})"]
    if baseline:
        headers.append(f"transformers (batch {baseline['batch_size']})")
    metrics = [
        ("requests/s", "requests_per_s", lambda v: _num(v, 2)),
        ("output tokens/s", "output_tokens_per_s", _num),
        ("total tokens/s", "total_tokens_per_s", _num),
        ("duration (s)", "duration_s", lambda v: _num(v, 2)),
        ("output tokens", "output_tokens", str),
        ("peak memory (MiB)", "peak_memory_bytes", _mib),
    ]
    rows = []
    for label, key, show in metrics:
        row = [label, show(engine[key])]
        if baseline:
            row.append(show(baseline[key]))
        rows.append(row)
    ttft = engine["ttft_ms"]
    blocks = f"{engine['peak_kv_blocks_used']} / {engine['kv_blocks_total']}"
    engine_only = [
        ("first token p50 / p99 (ms)", f"{_pct(ttft, 'p50')} / {_pct(ttft, 'p99')}"),
        (f"peak KV blocks used / total ({engine['block_size']} tokens each)", blocks),
        ("peak KV cache in use (MiB)", _mib(engine["peak_kv_cache_bytes"])),
    ]
    no_value = ["-"] if baseline else []
    rows += [[label, value, *no_value] for label, value in engine_only]
    if baseline:
        rows.append(
            [
                "tokens generated incl. padding",
                str(engine["output_tokens"]),
                str(baseline["generated_tokens"]),
            ]
        )
    return headers, rows


# The step profile's phases (llmctl/engine/step_profile.py), as the table names them.
STEP_PHASES = {
    "schedule": "schedule",
    "inputs": "build inputs",
    "model": "model call",
    "sample": "sample",
    "wait": "wait for the device",
    "outputs": "outputs (tokens, stops, detokenize)",
    "deliver": "hand outputs over",
}


def step_profile_table(profile: dict[str, Any]) -> Rows:
    """Where a step's time went: ms per step, share of the step and µs per sequence per
    step (the phase's time over the sequences the steps scheduled), per phase; then the
    host's work (everything but the model call and the wait for the device)."""
    rows = [
        [
            label,
            _num(profile["step_ms"][phase], 3),
            _num(profile["share"][phase] * 100),
            _num(profile["seq_us"][phase], 2),
        ]
        for phase, label in STEP_PHASES.items()
    ]
    host_ms = sum(profile["step_ms"][p] for p in STEP_PHASES if p not in ("model", "wait"))
    rows.append(
        [
            "host work (all but model call and wait)",
            _num(host_ms, 3),
            _num(profile["host_share"] * 100),
            _num(profile["host_seq_us"], 2),
        ]
    )
    rows.append(
        [
            "steps / mean sequences per step",
            f"{profile['steps']} / {profile['mean_batch_seqs']:.1f}",
            "-",
            "-",
        ]
    )
    rows.append(["idle, no work (s)", _num(profile["idle"], 3), "-", "-"])
    spec = profile.get("speculation") or {}
    if spec.get("steps"):
        rows.append(
            [
                "speculation: proposed / accepted tokens",
                f"{spec['proposed']} / {spec['accepted']}",
                _num(spec["acceptance_rate"] * 100),
                "-",
            ]
        )
        by_position = " ".join(f"{rate * 100:.0f}" for rate in spec["acceptance_by_position"])
        rows.append(["speculation: % accepted by position", by_position, "-", "-"])
    return ["phase", "ms per step", "% of step", "µs per sequence per step"], rows


def serve_table(report: dict[str, Any]) -> Rows:
    result = report["result"]
    rows = [
        ["requests completed / errors", f"{result['completed']} / {result['errors']}"],
        ["duration (s)", _num(result["duration_s"], 2)],
        ["requests/s", _num(result["requests_per_s"], 2)],
        ["output tokens/s", _num(result["output_tokens_per_s"])],
        ["total tokens/s", _num(result["total_tokens_per_s"])],
    ]
    for label, key in (
        ("time to first token (ms)", "ttft_ms"),
        ("time per output token (ms)", "tpot_ms"),
        ("inter-token latency (ms)", "itl_ms"),
    ):
        summary = result[key]
        rows.append(
            [
                f"{label} p50 / p90 / p99",
                " / ".join(_pct(summary, p) for p in ("p50", "p90", "p99")),
            ]
        )
    return ["metric", "value"], rows


def sweep_table(report: dict[str, Any]) -> Rows:
    serve = report["serve_load"] is not None
    # Short headers: the table has up to ten columns. TTFT: time to first token.
    headers = [
        "block size",
        "req/s",
        "out tok/s",
        "TTFT p50 ms",
        "KV blocks",
        "KV MiB",
        "peak mem MiB",
    ]
    if serve:
        headers += ["serve out tok/s", "serve TTFT p50/p99 ms", "serve ITL p50 ms"]
    rows = []
    for run in report["runs"]:
        engine = run["throughput"]["engine"]
        row = [
            str(run["block_size"]),
            _num(engine["requests_per_s"], 2),
            _num(engine["output_tokens_per_s"]),
            _pct(engine["ttft_ms"], "p50"),
            str(engine["peak_kv_blocks_used"]),
            _mib(engine["peak_kv_cache_bytes"]),
            _mib(engine["peak_memory_bytes"]),
        ]
        if serve:
            result = run["serve"]
            row += [
                _num(result["output_tokens_per_s"]),
                f"{_pct(result['ttft_ms'], 'p50')} / {_pct(result['ttft_ms'], 'p99')}",
                _pct(result["itl_ms"], "p50"),
            ]
        rows.append(row)
    return headers, rows


def variant_label(options: dict[str, str], baseline: dict[str, str]) -> str:
    """``quantization=int8, kv_cache_dtype=int8``: the options that differ from ``baseline``."""
    changed = [f"{k}={v}" for k, v in options.items() if baseline.get(k) != v]
    return ", ".join(changed) or "unquantized"


def quality_table(report: dict[str, Any]) -> Rows:
    """One column for the unquantized run and one per variant (value, then its ratio)."""
    baseline, runs = report["baseline"], report["runs"]
    headers = ["metric", "unquantized"]
    headers += [variant_label(run["options"], baseline["options"]) for run in runs]
    metrics = [
        ("tokens/s (batch 1)", "tokens_per_s", _num),
        ("weights (MiB)", "weight_bytes", _mib),
        ("KV cache per token (KiB)", "kv_bytes_per_token", lambda v: _num(v / 1024, 2)),
        ("perplexity of the text", "perplexity", lambda v: _num(v, 3)),
    ]
    rows = []
    for label, key, show in metrics:
        row = [label, show(baseline[key])]
        for run in runs:
            ratio = run["ratios"][key]
            row.append(show(run[key]) + ("" if ratio is None else f" ({ratio:.2f}x)"))
        rows.append(row)
    agreement = [
        ("greedy agreement (steps to first difference)", "greedy_agreement"),
        ("teacher-forced top-1 agreement", "teacher_forced_agreement"),
    ]
    for label, key in agreement:
        rows.append([label, "-"] + [f"{run[key]:.1%}" for run in runs])
    return headers, rows


def load_average_text(start: float | None, end: float | None) -> str:
    """The line under a benchmark's table that says how busy the machine was
    (``llmctl.bench.throughput.load_average`` before the first round and after the last)."""
    return f"Load average (1 min): {start} at the start, {end} at the end"


def markdown(table: Rows) -> str:
    headers, rows = table
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def rich_table(table: Rows, title: str) -> Table:
    from rich.table import Table

    headers, rows = table
    rendered = Table(title=title)
    for header in headers:  # fold a long name over lines rather than cut it short
        rendered.add_column(header, overflow="fold")
    for row in rows:
        rendered.add_row(*row)
    return rendered
