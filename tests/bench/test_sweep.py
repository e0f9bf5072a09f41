"""`llmctl bench sweep`: one fresh engine per block size, a table, a JSON report, a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.bench.sweep import parse_block_sizes
from llmctl.errors import OptionError
from tests.bench.cli_runner import invoke, q, read_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 300
    assert pixels.std() > 0  # something was drawn


def test_sweep_offline(stories_dir: Path, tmp_path: Path) -> None:
    out, chart = tmp_path / "sweep.json", tmp_path / "charts" / "sweep.png"
    result = invoke(
        f"bench sweep {q(stories_dir)} --backend torch --cache-block-seq-len 16,64 -n 4 "
        f"--input-len 20:70 --output-len 4 --chart {q(chart)} --output {q(out)} --markdown"
    )
    report = read_json(out)
    assert report["kind"] == "sweep" and report["serve_load"] is None
    assert [run["block_size"] for run in report["runs"]] == [16, 64]
    for run in report["runs"]:
        engine = run["throughput"]["engine"]
        assert run["serve"] is None
        assert run["throughput"]["settings"]["cache_block_seq_len"] == run["block_size"]
        assert engine["block_size"] == run["block_size"]
        assert engine["num_requests"] == 4 and engine["output_tokens"] == 16
        assert engine["output_tokens_per_s"] > 0 and engine["peak_kv_blocks_used"] >= 1
    # Same seeded workload for every block size.
    assert (
        report["runs"][0]["throughput"]["workload"] == report["runs"][1]["throughput"]["workload"]
    )
    # Prompts of 20..74 tokens need more 16-token blocks than 64-token ones.
    small, large = (run["throughput"]["engine"]["peak_kv_blocks_used"] for run in report["runs"])
    assert small > large
    assert_valid_png(chart)
    assert "| block size |" in result.output


@pytest.mark.slow
def test_sweep_with_serve_runs(stories_dir: Path, tmp_path: Path) -> None:
    out, chart = tmp_path / "sweep.json", tmp_path / "sweep.png"
    invoke(
        f"bench sweep {q(stories_dir)} --backend torch --cache-block-seq-len 16,32 -n 4 "
        f"--input-len 8:24 --output-len 6 --serve --concurrency 2 --chart {q(chart)} "
        f"--output {q(out)}"
    )
    report = read_json(out)
    assert report["serve_load"] == {"concurrency": 2, "request_rate": None}
    for run in report["runs"]:
        serve = run["serve"]
        assert serve["completed"] == 4 and serve["errors"] == 0
        assert serve["output_tokens"] == serve["requested_output_tokens"] == 24
        assert serve["ttft_ms"]["p50"] > 0 and serve["output_tokens_per_s"] > 0
    assert_valid_png(chart)


def test_parse_block_sizes() -> None:
    assert parse_block_sizes("16,32, 64") == [16, 32, 64]
    for bad in ("", "16,x", "0,16", "16,16"):
        with pytest.raises(OptionError, match="--cache-block-seq-len"):
            parse_block_sizes(bad)


def test_flags_to_args_gives_serve_the_same_options() -> None:
    from llmctl.bench.server_process import flags_to_args

    flags = {
        "backend": "torch",
        "cache_block_seq_len": 32,
        "enable_prefix_caching": False,
        "api_keys": ["a", "b"],
        "lora": {"x": "/a", "y": "/b"},
    }
    assert flags_to_args(flags) == [
        "--backend", "torch", "--cache-block-seq-len", "32", "--no-enable-prefix-caching",
        "--api-keys", "a", "--api-keys", "b", "--lora", "x=/a", "--lora", "y=/b",
    ]  # fmt: skip
