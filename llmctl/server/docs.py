"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) with their assets from the package.

fastapi-offline ships both bundles and serves Swagger UI; ReDoc is served here, from
the same package, because its bundle shows a logo from its vendor's CDN in the
sidebar. That one URL is replaced by an empty image (ReDoc then hides the logo), so
the docs, like the chat page, make the browser contact no other host.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse, Response

_REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
_REDOC_JS = "/docs-assets/redoc.standalone.js"


@cache
def _redoc_bundle() -> bytes:
    source = (files("fastapi_offline") / "static" / "redoc.standalone.js").read_text("utf-8")
    return source.replace(_REDOC_LOGO, "data:,").encode("utf-8")


def install_redoc(app: FastAPI) -> None:
    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - ReDoc",
            redoc_js_url=_REDOC_JS,
            redoc_favicon_url="/static-offline-docs/favicon.png",
            with_google_fonts=False,
        )

    @app.get(_REDOC_JS, include_in_schema=False)
    async def redoc_bundle() -> Response:
        return Response(
            _redoc_bundle(),
            media_type="text/javascript",
            headers={"Cache-Control": "public, max-age=86400"},
        )
