"""`llmctl bench throughput` on stories260K, beside a real transformers baseline."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.errors import LlmctlError, OptionError
from tests.bench.cli_runner import invoke, invoke_failing, q, read_json

ENGINE_FIELDS = {
    "duration_s",
    "num_requests",
    "prompt_tokens",
    "output_tokens",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "ttft_ms",
    "peak_kv_blocks_used",
    "kv_blocks_total",
    "block_size",
    "peak_kv_cache_bytes",
    "peak_memory_bytes",
    "memory_measure",
}
BASELINE_FIELDS = {
    "name",
    "version",
    "batch_size",
    "duration_s",
    "num_requests",
    "prompt_tokens",
    "output_tokens",
    "generated_tokens",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "peak_memory_bytes",
    "memory_measure",
}


def test_throughput_with_transformers_baseline(stories_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    result = invoke(
        f"bench throughput {q(stories_dir)} --backend torch --cache-block-seq-len 16 -n 6 "
        "--input-len 8:40 --output-len 3:12 --seed 3 --baseline transformers "
        f"--baseline-batch-size 4 --output {q(out)} --markdown"
    )
    report = read_json(out)
    workload, engine, baseline = report["workload"], report["engine"], report["baseline"]
    assert report["kind"] == "throughput" and report["backend"] == "torch"
    assert report["settings"]["cache_block_seq_len"] == 16
    assert report["machine"]["torch_threads"] == 1  # tests/bench/conftest.py
    load = report["machine"]["load_average"]  # this machine's, as the OS keeps it
    assert load["start"] >= 0 and load["end"] >= 0
    assert f"Load average (1 min): {load['start']} at the start, {load['end']} at the end" in (
        result.output
    )
    assert workload["num_prompts"] == 6 and workload["seed"] == 3
    assert workload["input_len"] == [8, 40] and workload["output_len"] == [3, 12]

    assert set(engine) == ENGINE_FIELDS
    assert engine["num_requests"] == 6
    assert engine["output_tokens"] == workload["output_tokens"]  # ignore_eos: all asked for
    assert engine["prompt_tokens"] == workload["prompt_tokens"]
    assert 8 * 6 <= workload["prompt_tokens"] <= 40 * 6
    for key in ("duration_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert engine[key] > 0
    assert engine["output_tokens_per_s"] == pytest.approx(
        engine["output_tokens"] / engine["duration_s"]
    )
    assert engine["block_size"] == 16
    # Every request holds at least one block while it runs; none more than 52/16 -> 4.
    assert 1 <= engine["peak_kv_blocks_used"] <= 6 * 4 <= engine["kv_blocks_total"]
    # stories260K: 5 layers x 4 KV heads x head_dim 8 x K and V x fp32 = 1280 B per token.
    assert engine["peak_kv_cache_bytes"] == engine["peak_kv_blocks_used"] * 16 * 1280
    assert engine["peak_memory_bytes"] > 50 * 2**20
    assert 0 < engine["ttft_ms"]["p50"] <= engine["ttft_ms"]["p99"]

    assert set(baseline) == BASELINE_FIELDS
    assert baseline["num_requests"] == 6 and baseline["batch_size"] == 4
    assert baseline["output_tokens"] == workload["output_tokens"]
    assert baseline["generated_tokens"] >= baseline["output_tokens"]  # padding is extra work
    assert baseline["duration_s"] > 0 and baseline["output_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(
        engine["output_tokens_per_s"] / baseline["output_tokens_per_s"]
    )
    assert report["rounds"] == [
        {
            "engine_output_tokens_per_s": engine["output_tokens_per_s"],
            "baseline_output_tokens_per_s": baseline["output_tokens_per_s"],
            "ratio": report["ratio"],
        }
    ]
    assert "| metric | llmctl (torch) | transformers (batch 4) |" in result.output
    assert f"useful output tokens/s: {report['ratio']:.2f}x" in result.output
    assert "[bold]" not in result.output  # the console reads no markup: style it, do not tag it


def test_rounds_take_turns_and_report_medians(stories_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    result = invoke(
        f"bench throughput {q(stories_dir)} --backend torch -n 3 --input-len 8 "
        f"--output-len 4:8 --baseline transformers --rounds 3 --output {q(out)}"
    )
    report = read_json(out)
    rounds = report["rounds"]
    assert len(rounds) == 3
    for round_ in rounds:
        assert round_["ratio"] == pytest.approx(
            round_["engine_output_tokens_per_s"] / round_["baseline_output_tokens_per_s"]
        )
    # Each side is its median round, whole; the ratio is the median of the rounds' own.
    engine_rates = sorted(r["engine_output_tokens_per_s"] for r in rounds)
    baseline_rates = sorted(r["baseline_output_tokens_per_s"] for r in rounds)
    assert report["engine"]["output_tokens_per_s"] == engine_rates[1]
    assert report["engine"]["output_tokens"] == report["workload"]["output_tokens"]
    assert report["baseline"]["output_tokens_per_s"] == baseline_rates[1]
    assert report["ratio"] == sorted(r["ratio"] for r in rounds)[1]
    assert "Rounds, output tokens/s: " in result.output
    assert f"the median of the rounds' ratios: {report['ratio']:.2f}x" in result.output


def test_throughput_refuses_a_workload_longer_than_the_session(stories_dir: Path) -> None:
    result = invoke_failing(
        f"bench throughput {q(stories_dir)} --backend torch --session-len 64 -n 2 "
        "--input-len 60 --output-len 10"
    )
    assert isinstance(result.exception, LlmctlError)
    assert "session_len is 64" in str(result.exception)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--input-len 9:2", "--input-len"),
        ("--output-len x", "--output-len"),
        ("--baseline vllm", "only baseline is `transformers`"),
    ],
)
def test_bad_arguments_are_named(args: str, message: str) -> None:
    result = invoke_failing(f"bench throughput demo {args}")
    assert isinstance(result.exception, OptionError)
    assert message in str(result.exception)


def test_a_block_size_the_backend_refuses_is_an_error(stories_dir: Path) -> None:
    result = invoke_failing(
        f"bench throughput {q(stories_dir)} --backend torch --cache-block-seq-len 48"
    )
    assert isinstance(result.exception, LlmctlError)
    assert "cache_block_seq_len" in str(result.exception)


def test_step_profile_shows_where_the_steps_spent_their_time(
    stories_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "profiled.json"
    result = invoke(
        f"bench throughput {q(stories_dir)} --backend torch --cache-block-seq-len 16 -n 5 "
        f"--input-len 8 --output-len 6 --step-profile --output {q(out)} --markdown"
    )
    profile = read_json(out)["engine"]["step_profile"]
    phases = ["schedule", "inputs", "model", "sample", "wait", "outputs", "deliver"]
    # Five requests admitted in one step, then one decode step per further token.
    assert profile["steps"] == 6 and profile["scheduled_seqs"] == 30
    assert profile["mean_batch_seqs"] == pytest.approx(5.0)
    assert all(profile[phase] >= 0 for phase in phases) and profile["model"] > 0
    assert sum(profile["share"].values()) == pytest.approx(1.0)
    busy = sum(profile[phase] for phase in phases)
    host = busy - profile["model"] - profile["wait"]
    assert profile["host_share"] == pytest.approx(host / busy)
    assert profile["step_ms"]["model"] == pytest.approx(profile["model"] * 1000 / 6)
    # Per sequence per step: over the 30 sequence-steps scheduled.
    assert profile["seq_us"]["outputs"] == pytest.approx(profile["outputs"] * 1e6 / 30)
    assert profile["host_seq_us"] == pytest.approx(host * 1e6 / 30)
    assert "**Where a step's time goes**" in result.output
    assert "| µs per sequence per step |" in result.output
    host_row = next(line for line in result.output.splitlines() if line.startswith("| host work ("))
    assert host_row.split("|")[4].strip() == f"{profile['host_seq_us']:.2f}"


def test_step_profile_shows_speculation(stories_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "speculated.json"
    result = invoke(
        f"bench throughput {q(stories_dir)} --backend torch --cache-block-seq-len 16 -n 3 "
        f"--input-len 8 --output-len 40 --speculative-method ngram --ngram-min 1 "
        f"--step-profile --output {q(out)} --markdown"
    )
    spec = read_json(out)["engine"]["step_profile"]["speculation"]
    assert spec["proposed"] > 0 and 0 <= spec["accepted"] <= spec["proposed"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["proposed"])
    # One rate per position proposed: up to num_speculative_tokens (4), as many as the
    # adaptive rule chose at most, which follows the measured step times.
    by_position = spec["acceptance_by_position"]
    assert 1 <= len(by_position) <= 4 and all(0.0 <= rate <= 1.0 for rate in by_position)
    assert f"{spec['proposed']} / {spec['accepted']}" in result.output
