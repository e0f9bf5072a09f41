"""The chat page at ``/``: static files from this package, no build step.

``static/`` holds plain HTML, CSS and JavaScript that load nothing from outside: the
page talks only to this server's public API (``/v1/models``, ``/v1/chat/completions``)
and to ``/stats`` for its server panel. ``web_ui = false`` leaves it out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def install_web_ui(app: FastAPI) -> None:
    """``/`` answers the page; ``/web/...`` its script and style sheet."""
    app.mount("/web", StaticFiles(directory=STATIC), name="web")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
