"""`llmctl bench serve` against a real `llmctl serve` subprocess on stories260K."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmctl.errors import OptionError
from tests.bench.cli_runner import invoke, invoke_failing, q, read_json
from tests.conftest import STORIES
from tests.helpers.server_process import running_server

LATENCY_FIELDS = ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms")


@pytest.fixture(scope="module")
def stories_server() -> Iterator[str]:
    """One server for the module: starting one takes seconds."""
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    args = [str(STORIES), "--backend", "torch", "--model-name", "stories"]
    with running_server(args, env={"OMP_NUM_THREADS": "1"}) as url:
        yield url


def test_serve_load_by_concurrency_and_by_rate(stories_server: str, tmp_path: Path) -> None:
    url = stories_server
    by_concurrency, by_rate = tmp_path / "concurrency.json", tmp_path / "rate.json"
    result = invoke(
        f"bench serve --url {url} --tokenizer {q(STORIES)} -n 5 --concurrency 2 "
        f"--input-len 8:30 --output-len 4:9 --output {q(by_concurrency)} --markdown"
    )
    invoke(
        f"bench serve --url {url} --tokenizer {q(STORIES)} -n 4 --request-rate 20 "
        f"--input-len 10 --output-len 5 --output {q(by_rate)}"
    )

    report = read_json(by_concurrency)
    assert report["model"] == "stories"  # asked /v1/models
    assert report["load"] == {"concurrency": 2, "request_rate": None}
    run, workload = report["result"], report["workload"]
    assert run["num_requests"] == run["completed"] == 5 and run["errors"] == 0
    assert run["output_tokens"] == run["requested_output_tokens"] == workload["output_tokens"]
    assert run["prompt_tokens"] == workload["prompt_tokens"]
    assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
    for key in LATENCY_FIELDS:
        summary = run[key]
        assert 0 <= summary["p50"] <= summary["p90"] <= summary["p99"], key
    assert run["ttft_ms"]["p50"] <= run["latency_ms"]["p50"]
    assert "| time to first token (ms) p50 / p90 / p99 |" in result.output

    rate = read_json(by_rate)
    assert rate["load"] == {"concurrency": None, "request_rate": 20.0}
    assert rate["result"]["completed"] == 4 and rate["result"]["output_tokens"] == 20


def test_errors_are_counted_not_raised(stories_server: str, tmp_path: Path) -> None:
    """A model name the server does not serve: every request fails, and says why."""
    out = tmp_path / "errors.json"
    invoke(
        f"bench serve --url {stories_server} --model no-such-model --tokenizer {q(STORIES)} "
        f"-n 3 --concurrency 3 --output {q(out)}"
    )
    run = read_json(out)["result"]
    assert run["errors"] == 3 and run["completed"] == 0
    assert run["error_examples"] and "HTTP 404" in run["error_examples"][0]


def test_serve_needs_a_load_shape() -> None:
    result = invoke_failing("bench serve --url http://127.0.0.1:9 -n 2")
    assert isinstance(result.exception, OptionError)
    assert "--concurrency" in str(result.exception)


@pytest.mark.parametrize("flag", ["--concurrency", "--request-rate"])
def test_unreachable_server_is_reported(flag: str, tmp_path: Path) -> None:
    out = tmp_path / "down.json"
    invoke(f"bench serve --url http://127.0.0.1:9 --model demo -n 2 {flag} 5 --output {q(out)}")
    run = read_json(out)["result"]
    assert run["errors"] == 2 and run["completed"] == 0 and "Connect" in run["error_examples"][0]
