"""A Content-Security-Policy on every HTML page the server answers (the chat page,
``/docs``, ``/redoc``): the browser loads scripts, styles, images and connections from
this server only.

The page and the docs bundles are in the package, so nothing needs another host; the
policy makes that a guarantee rather than a habit. (ReDoc's bundle, for one, shows a
logo from its vendor's CDN in the sidebar; under this policy the browser never asks
for it, and ReDoc hides the image.) Plain ASGI, so streamed answers pass untouched.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Swagger UI and ReDoc start from an inline script and style their parts inline;
# ReDoc's search runs in a worker made from a blob.
POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
    "connect-src 'self'; base-uri 'self'; form-action 'self'"
)


class ContentSecurityPolicy:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_policy(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if headers.get("content-type", "").startswith("text/html"):
                    headers["Content-Security-Policy"] = POLICY
            await send(message)

        await self.app(scope, receive, send_with_policy)
