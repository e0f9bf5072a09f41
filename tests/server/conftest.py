"""One real ``llmctl serve`` on stories260K shared by the server tests (it takes seconds
to start), with an API key so every test also exercises auth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server

API_KEY = "test-key-5b1f"
SESSION_LEN = 512  # stories260K's context length
QUIET_THREADS = {"OMP_NUM_THREADS": "1"}  # the test machine is small and shared


@dataclass
class Server:
    process: ServerProcess
    url: str
    api_key: str

    def client(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)

    def metric(self, sample: str, default: float | None = None) -> float:
        """One sample from /metrics, named as Prometheus prints it (labels included);
        ``default`` for a labelled counter that has not been incremented yet."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[1])
        if default is not None:
            return default
        raise AssertionError(f"{sample} not found in /metrics")


def stories_or_skip() -> None:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (it lives in ../shared/models/)")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    stories_or_skip()
    args = [str(STORIES), "--backend", "torch", "--api-key", API_KEY]
    process = start_server([*args, "--cache-block-seq-len", "16"], env=QUIET_THREADS)
    try:
        yield Server(process, process.url, API_KEY)
    finally:
        process.stop()


# A Qwen2.5-style template (tools, tool calls, tool results, enable_thinking).
HERMES_TEMPLATE = Path(__file__).parents[1] / "data" / "hermes_tools_template.jinja"


@pytest.fixture(scope="session")
def demo_url() -> Iterator[str]:
    """``/v1`` of a ``llmctl serve demo`` with the Hermes tools template (random weights:
    what it writes is noise, which grammars must still hold to their shape)."""
    process = start_server(
        ["demo", "--backend", "torch", "--chat-template", str(HERMES_TEMPLATE)],
        env=QUIET_THREADS,
    )
    try:
        yield f"{process.url}/v1"
    finally:
        process.stop()


@pytest.fixture(scope="session")
def reference() -> list[dict[str, Any]]:
    """transformers' greedy continuations of stories260K (48 new tokens each)."""
    stories_or_skip()
    return json.loads((STORIES / "reference_greedy.json").read_text())["results"]
