"""``llmctl serve`` refuses a port in use at once, before loading the model."""

from __future__ import annotations

from urllib.parse import urlsplit

from tests.helpers.cli import run_llmctl
from tests.server.conftest import Server


def test_a_port_in_use_is_a_clear_error(server: Server) -> None:
    port = str(urlsplit(server.url).port)
    result = run_llmctl("serve", "demo", "--backend", "torch", "--port", port, timeout=60)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "--port" in result.stderr
    assert "Traceback" not in result.stderr
