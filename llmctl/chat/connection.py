"""Where a chat's answers come from: the ``Connection`` protocol and the in-process one."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from llmctl.backend import Engine, GenerationRequest, capabilities
from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import LlmctlError


class NoChatTemplate(LlmctlError):
    """The other side refused chat messages because its model has no chat template."""


@dataclass
class Delta:
    """What one step of a stream adds. ``completion_tokens`` is a running total, when known."""

    text: str = ""
    completion_tokens: int | None = None
    finish_reason: str | None = None


class Connection(Protocol):
    """Where answers come from: an in-process engine or a remote server."""

    model_name: str
    has_chat_template: bool

    def stream(
        self,
        sampling: SamplingParams,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream one answer; leaving the iteration early stops it on the other side.

        Raises ``NoChatTemplate`` if ``messages`` are refused for want of a template.
        """
        ...

    async def stats(self) -> list[tuple[str, str]]: ...

    async def close(self) -> None: ...


class LocalConnection:
    """Answers from an engine running in this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        # Local engines apply the chat template themselves (EngineCapabilities).
        self.has_chat_template = capabilities(engine).has_chat_template

    async def stream(
        self,
        sampling: SamplingParams,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[Delta]:
        request_id = f"chat-{uuid.uuid4().hex}"
        request = GenerationRequest(request_id, prompt=prompt, messages=messages, sampling=sampling)
        finished = False
        try:
            async with aclosing(self.engine.generate(request)) as outputs:
                async for output in outputs:
                    finished = output.finished
                    yield Delta(output.text, output.completion_tokens, output.finish_reason)
        finally:
            if not finished:  # stopped by the user: free the engine's slot and KV blocks
                await self.engine.abort(request_id)

    async def stats(self) -> list[tuple[str, str]]:
        stats = self.engine.stats()
        return [
            ("requests running", str(stats.running)),
            ("requests waiting", str(stats.waiting)),
            ("KV blocks used", f"{stats.kv_blocks_used} of {stats.kv_blocks_total}"),
            ("KV block size", f"{stats.block_size} tokens"),
            ("session length", f"{self.engine.max_model_len} tokens"),
        ]

    async def close(self) -> None:
        await self.engine.shutdown()
