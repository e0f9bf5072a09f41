"""/health follows the engine: 200 while its loop runs, 503 once it has stopped."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import uvicorn

from llmctl.selection import select
from llmctl.server.app import create_app
from tests.helpers.server_process import free_port


def test_health_turns_503_when_the_engine_loop_stops(stories_dir):
    choice = select(str(stories_dir), {"backend": "torch", "cache_max_entry_count": 64})
    engine = choice.create_engine()
    app = create_app(engine, backend_name="torch")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").status_code == 200
        asyncio.run(engine.shutdown())  # the engine loop ends; the HTTP server lives on
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503
        assert response.json() == {"status": "engine stopped"}
    finally:
        server.should_exit = True
        thread.join(timeout=30)
