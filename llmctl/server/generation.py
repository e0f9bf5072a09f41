"""Run the engine requests of one HTTP request together and merge their outputs.

An HTTP request becomes one engine request per choice (``n`` per prompt, several
prompts for a batched completion). They are all submitted at once so the engine batches
them; ``start`` waits until each has produced its first output, so a request the engine
refuses (too long, say) still becomes a 400 before any response has been sent.
``close`` aborts whatever is still running, which frees its KV blocks: it runs however
the response ends (finished, client gone, server shutting down).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from llmctl.backend import Engine, GenerationOutput, GenerationRequest, TokenLogprob
from llmctl.server.metrics import ServerMetrics


@dataclass
class ChoiceProgress:
    """What one choice has done so far: its text, token counts, timings, how it ended."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # a list when the request asked for them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    refused: bool = False  # the engine turned it down before it started
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache
    prompt_logprobs: list[TokenLogprob] | None = None  # when the request asked for them

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


_DONE = object()  # a choice's pump has ended


class GenerationStream:
    """``outputs()`` yields ``(choice index, GenerationOutput)`` as the engine produces them."""

    def __init__(
        self,
        engine: Engine,
        requests: list[GenerationRequest],
        metrics: ServerMetrics,
        arrived_at: float,
    ) -> None:
        self.engine = engine
        self.requests = requests
        self.metrics = metrics
        self.arrived_at = arrived_at  # time.monotonic() when the HTTP request came in
        self.progress = [
            ChoiceProgress(logprobs=[] if request.sampling.logprobs else None)
            for request in requests
        ]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    @classmethod
    async def start(
        cls,
        engine: Engine,
        requests: list[GenerationRequest],
        metrics: ServerMetrics,
        arrived_at: float,
    ) -> GenerationStream:
        """Submit every request; raise the engine's error (InvalidRequest...) if any refuses."""
        stream = cls(engine, requests, metrics, arrived_at)
        loop = asyncio.get_running_loop()
        ready = [loop.create_future() for _ in requests]
        stream._tasks = [
            asyncio.create_task(stream._pump(index, request, ready[index]))
            for index, request in enumerate(requests)
        ]
        try:
            outcomes = await asyncio.gather(*ready, return_exceptions=True)
        except BaseException:  # cancelled: the client went away
            await stream.close()
            raise
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if errors:
            await stream.close()
            raise errors[0]
        return stream

    async def _pump(self, index: int, request: GenerationRequest, ready: asyncio.Future) -> None:
        try:
            async for output in self.engine.generate(request):
                self._record(index, output)
                if not ready.done():
                    ready.set_result(None)
                self._queue.put_nowait((index, output))
        except Exception as exc:
            if not ready.done():
                self.progress[index].refused = True
                ready.set_exception(exc)  # refused up front: start() raises it
            else:
                self._queue.put_nowait((index, exc))
        finally:
            if not ready.done():
                ready.set_result(None)
            self._queue.put_nowait((index, _DONE))

    def _record(self, index: int, output: GenerationOutput) -> None:
        progress = self.progress[index]
        now = time.monotonic()
        progress.text_parts.append(output.text)
        if progress.logprobs is not None and output.logprobs:
            progress.logprobs.extend(output.logprobs)
        progress.prompt_tokens = output.prompt_tokens
        if output.cached_tokens is not None:
            progress.cached_tokens = output.cached_tokens
        if output.prompt_logprobs is not None:
            progress.prompt_logprobs = output.prompt_logprobs
        if output.completion_tokens > progress.completion_tokens:
            # Counted as they come, so a rate read from /metrics or /stats is live.
            self.metrics.generation_tokens.inc(
                output.completion_tokens - progress.completion_tokens
            )
            if progress.first_token_at is None:
                progress.first_token_at = now
                self.metrics.time_to_first_token.observe(now - self.arrived_at)
            progress.last_token_at = now
        progress.completion_tokens = output.completion_tokens
        if output.finished:
            progress.finish_reason = output.finish_reason
            self._record_finished(progress)

    def _record_finished(self, progress: ChoiceProgress) -> None:
        self.metrics.prompt_tokens.inc(progress.prompt_tokens)
        self.metrics.finished.labels(reason=progress.finish_reason or "unknown").inc()
        if progress.completion_tokens > 1:
            decode_time = progress.last_token_at - progress.first_token_at
            self.metrics.time_per_output_token.observe(
                decode_time / (progress.completion_tokens - 1)
            )

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """Every choice's outputs, interleaved as they come; raises an engine failure."""
        remaining = len(self.requests)
        while remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    async def close(self) -> None:
        """Abort unfinished choices and wait for their pumps; safe to call twice.

        Shielded: it also runs when the response is being cancelled (client gone).
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()  # cancels the engine's generate(), which aborts its request
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for request, progress in zip(self.requests, self.progress):
                if progress.finish_reason is None and not progress.refused:
                    await self.engine.abort(request.request_id)
                    progress.finish_reason = "abort"
                    self._record_finished(progress)

    def usage(self, choices_per_prompt: int) -> dict[str, Any]:
        """OpenAI's usage: each distinct prompt counted once, every choice's tokens; with
        ``prompt_tokens_details.cached_tokens`` where the engine reports prefix-cache hits
        (the first choice of each prompt: its batch mates hit the blocks it just wrote)."""
        firsts = self.progress[::choices_per_prompt]
        prompt = sum(p.prompt_tokens for p in firsts)
        completion = sum(p.completion_tokens for p in self.progress)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if any(p.cached_tokens is not None for p in firsts):
            cached = sum(p.cached_tokens or 0 for p in firsts)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage
