"""The soak's machinery on a short, counted run against a real ``llmctl serve``: every
kind of request, dropped streams, greedy answers checked, KV blocks back to 0."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from llmctl.bench.soak import GREEDY_CASES, SoakSettings, report_markdown, run_soak
from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES}")
    server = start_server([str(STORIES), "--backend", "torch"], env={"OMP_NUM_THREADS": "1"})
    try:
        yield server
    finally:
        server.stop()


def test_a_counted_soak_is_clean(server: ServerProcess) -> None:
    settings = SoakSettings(
        duration_s=None, max_requests=60, concurrency=8, disconnect_share=0.25, seed=3
    )
    report = asyncio.run(run_soak(server.url, settings))
    outcomes = report["outcomes"]
    assert report["requests"] == 60
    assert report["errors"] == {} and report["server_errors"] == 0, report["error_examples"]
    assert min(outcomes["greedy"], outcomes["sampled"], outcomes["disconnected"]) >= 5
    assert report["greedy_checked"] == outcomes["greedy"]
    assert report["greedy_mismatches"] == 0, report["mismatch_examples"]
    assert report["kv_blocks_used_when_idle"] == 0
    assert all(rss > 50 * 2**20 for _, rss in report["rss_bytes"])
    assert "| greedy answers checked / differing |" in report_markdown(report)


def test_an_answer_that_differs_from_the_reference_is_counted(server: ServerProcess) -> None:
    wrong = {case: "not what the model says" for case in GREEDY_CASES}
    settings = SoakSettings(
        duration_s=None, max_requests=6, concurrency=3, disconnect_share=0.0, greedy_share=1.0
    )
    report = asyncio.run(run_soak(server.url, settings, reference=wrong))
    assert report["greedy_checked"] == report["greedy_mismatches"] == 6
    assert report["mismatch_examples"][0]["expected"] == "not what the model says"
