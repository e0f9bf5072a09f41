"""Shared setup for the openai-proxy plugin tests: the plugin must be pip-installed (as
``.ci/run`` does), and one real ``llmctl serve`` on stories260K is the upstream."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "plugins" / "llmctl-openai-proxy"
DISTRIBUTION = "llmctl-openai-proxy"
UPSTREAM_KEY = "upstream-key-7c2e"  # the proxy must send it: exercises proxy_api_key


def require_plugin_installed() -> None:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            f"{DISTRIBUTION} is not installed in this environment: "
            f"`pip install -e {PLUGIN_DIR.relative_to(REPO)}` (as .ci/run does)"
        )


def require_stories() -> None:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (it lives in ../shared/models/)")


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus metric from ``url/metrics`` (0 when not exported yet)."""
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.MULTILINE)
    match = pattern.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(match.group(1)) if match else 0.0


def start_upstream() -> ServerProcess:
    """``llmctl serve`` on stories260K with the torch backend, behind an API key."""
    require_stories()
    return start_server(
        [str(STORIES), "--backend", "torch", "--api-key", UPSTREAM_KEY, "--max-batch-size", "8"]
    )


def start_proxy(upstream_url: str, *extra: str) -> ServerProcess:
    """``llmctl serve --backend openai-proxy`` in front of ``upstream_url``; the key comes
    from the environment, as the option's help recommends."""
    require_plugin_installed()
    return start_server(
        ["--backend", "openai-proxy", "--proxy-url", upstream_url, *extra],
        env={"LLMCTL_PROXY_API_KEY": UPSTREAM_KEY},
    )


@pytest.fixture(scope="session")
def upstream() -> Iterator[ServerProcess]:
    server = start_upstream()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def proxy(upstream: ServerProcess) -> Iterator[ServerProcess]:
    server = start_proxy(upstream.url)
    try:
        yield server
    finally:
        server.stop()
