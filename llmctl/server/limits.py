"""Admission: at most N requests generate at once, at most Q wait, the rest get 429.

A bounded queue rather than an unbounded pile: under overload a client learns at once
that it should come back later (``Retry-After``) instead of timing out in a queue that
only grows.
"""

from __future__ import annotations

import asyncio

from llmctl.server.errors import APIError

RETRY_AFTER_SECONDS = 1


class Admission:
    """Slots for generating requests plus a bounded waiting line.

    ``acquire`` either takes a slot, waits in line for one, or raises a 429 when the
    line is full. Every successful ``acquire`` must be paired with one ``release``.
    """

    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_running)

    async def acquire(self) -> None:
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise APIError(
                429,
                f"the server is at capacity: {self.running} requests are generating "
                f"(max_concurrent_requests={self.max_running}) and {self.waiting} are "
                f"waiting (max_queued_requests={self.max_waiting}); retry shortly",
                type="rate_limit_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._slots.release()
