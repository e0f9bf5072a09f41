"""Noticing a client that went away, for streamed and whole responses alike.

A disconnected client must not keep generating: its engine requests are aborted so
their KV blocks return to the pool. Streamed responses watch for ``http.disconnect``
while they write; whole responses race their work against it. A client that stops
reading a stream counts as gone once one write has waited ``send_timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from llmctl.server.errors import APIError

T = TypeVar("T")
log = logging.getLogger("llmctl.server")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def sse_event(payload: Any) -> str:
    """One Server-Sent Event carrying JSON (or the literal ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops when the client disconnects or stops reading for
    ``send_timeout`` seconds, and always runs ``on_close``.

    ``on_close`` runs however the response ends, even if it never started streaming,
    so a generation slot or an engine request is never leaked.
    """

    def __init__(
        self,
        events: AsyncIterable[str],
        on_close: Callable[[], Awaitable[None]],
        send_timeout: float,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await self.stream_response(self._timed(send))
                except TimeoutError:
                    log.warning(
                        "a client took no data for %gs (client_timeout): stream dropped",
                        self.send_timeout,
                    )
                except OSError:  # the client went away while we wrote to it
                    pass
                group.cancel_scope.cancel()
        except asyncio.CancelledError:
            # Only the server cancels us from outside: its shutdown timeout ran out.
            # End the stream properly, so the client sees why it stopped.
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await _send_farewell(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()

    def _timed(self, send: Send) -> Send:
        async def send_in_time(message: Message) -> None:
            with anyio.fail_after(self.send_timeout):
                await send(message)

        return send_in_time


async def _send_farewell(send: Send) -> None:
    error = APIError(
        503,
        "the server shut down before this generation finished",
        type="server_error",
        code="server_shutting_down",
    )
    body = sse_event({"error": error.body()}) + sse_event("[DONE]")
    try:
        await send({"type": "http.response.body", "body": body.encode(), "more_body": False})
    except OSError:
        pass  # the client is gone too


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone.

    Only for handlers that have read the whole body: the next ASGI message can then only
    be ``http.disconnect``.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
