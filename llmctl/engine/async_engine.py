"""``AsyncEngine``: the ``Engine`` surface (llmctl/backend.py) around ``LLMEngine``.

One background thread owns the ``LLMEngine``: it takes new requests and aborts from a
command queue, runs steps while there is work (torch releases the GIL while it
computes, so the event loop stays responsive) and sleeps when there is none. Each
request's outputs go to an ``asyncio.Queue`` on the event loop that called
``generate``, through ``loop.call_soon_threadsafe``, so any loop may use the engine:
the server's, or a fresh one per ``LLM.generate`` call.

Faults: a model call that raises fails the requests of its step with ``EngineError``
and the engine goes on. Several failed steps in a row mean the model itself is broken
(a lost GPU, say), and any other exception may have left the engine's own state
inconsistent: then the engine stops, fails everything in flight and ``is_alive()``
turns false, which the server reports as 503. ``EngineDead`` from the runner (a
tensor-parallel rank lost) or ``fail`` stops it the same way at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llmctl.backend import EngineStats, GenerationOutput, GenerationRequest
from llmctl.engine.llm_engine import LLMEngine, StepFailed
from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import EngineDead, EngineError, InvalidRequest

logger = logging.getLogger("llmctl")

MAX_FAILED_STEPS_IN_A_ROW = 3


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass
class _Abort:
    request_id: str


class _ResetPeak:
    """Start a new high-water mark of KV blocks in use."""


@dataclass
class _Fail:
    """Stop for good: the engine cannot run any more (see ``fail``)."""

    reason: str


_Command = _Add | _Abort | _ResetPeak | _Fail


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._lock = threading.Condition()  # guards the three fields below
        self._commands: list[_Command] = []
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self.failure: BaseException | None = None  # why the engine stopped by itself
        self._thread = threading.Thread(target=self._run, name="llmctl-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream a request's outputs; ``InvalidRequest`` before the first one if refused.

        Leaving the iteration early (a client disconnecting, a cancelled task) aborts the
        request, which frees its KV blocks.
        """
        prompt_ids = self._prompt_token_ids(request)
        self.engine.validate(prompt_ids, request.sampling)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        request_id = request.request_id
        with self._lock:
            if isinstance(self.failure, EngineDead):
                raise EngineDead(str(self.failure))
            if self.failure is not None:
                raise EngineError(f"the engine has stopped after a failure: {self.failure}")
            if self._stopping:
                raise EngineError("the engine has been shut down")
            if request_id in self._streams:
                raise InvalidRequest(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.append(_Add(request_id, prompt_ids, request.sampling))
            self._lock.notify()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._submit(_Abort(request_id))

    @property
    def has_chat_template(self) -> bool:
        """Whether ``messages`` go through a chat template (else their contents are joined)."""
        return self.tokenizer.has_chat_template

    def is_alive(self) -> bool:
        """The engine thread still runs (the server's /health answers 503 otherwise)."""
        return self._thread.is_alive() and not self._stopping and self.failure is None

    async def abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    def stats(self) -> EngineStats:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        with self._lock:
            pending = sum(isinstance(c, _Add) for c in self._commands)
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + pending,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_peak=blocks.peak_used_blocks,
            block_size=blocks.block_size,
            tensor_parallel_size=getattr(self.engine.runner, "tensor_parallel_size", 1),
        )

    def reset_peak_kv_blocks(self) -> None:
        """Start ``stats().kv_blocks_peak`` afresh from here (the bench, after warming up)."""
        self._submit(_ResetPeak())

    def fail(self, reason: str) -> None:
        """Stop for good, from any thread (a tensor-parallel rank was lost, say): requests
        in flight end with ``EngineDead(reason)``. ``is_alive`` turns false at once, even
        while the engine thread is still stuck in a step waiting for the lost rank."""
        with self._lock:
            if self.failure is None:
                self.failure = EngineDead(reason)
            self._commands.append(_Fail(reason))
            self._lock.notify()

    async def shutdown(self) -> None:
        """Stop the engine thread (requests still in flight end with ``abort``), then let
        the runner release what it holds beyond memory (worker processes)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        await asyncio.to_thread(self._thread.join)
        close = getattr(self.engine.runner, "close", None)
        if close is not None:
            await asyncio.to_thread(close)

    def _prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt)
        return self.tokenizer.encode_chat(request.messages)

    def _submit(self, command: _Command) -> None:
        with self._lock:
            self._commands.append(command)
            self._lock.notify()

    def _run(self) -> None:
        """The engine thread: run the loop; if it fails, stop and fail every request."""
        try:
            self._loop()
        except Exception as exc:
            dead = isinstance(exc, EngineDead)
            logger.error("the engine failed and has stopped: %s", exc, exc_info=not dead)
            with self._lock:
                self.failure = exc
            error = (
                EngineDead(str(exc))
                if dead
                else EngineError(f"the engine failed and has stopped: {exc}")
            )
            for request_id in self._stream_ids():
                self._deliver(request_id, error)
            return
        for request_id in self._stream_ids():
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver(request_id, output)

    def _loop(self) -> None:
        """Apply commands, step while there is work, sleep otherwise; until shutdown."""
        failed_in_a_row = 0
        while True:
            with self._lock:
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._lock.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                self._apply(command)
            if stopping:
                return
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except StepFailed as failed:
                if isinstance(failed.__cause__, EngineDead):
                    raise failed.__cause__ from None
                failed_in_a_row += 1
                if failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                    raise RuntimeError(
                        f"{failed_in_a_row} model calls failed in a row, the last with: "
                        f"{failed.__cause__!r}"
                    ) from failed.__cause__
                self._fail_step(failed)
                continue
            failed_in_a_row = 0
            for output in outputs:
                self._deliver(output.request_id, output)

    def _fail_step(self, failed: StepFailed) -> None:
        """End the requests of a step whose model call raised; the rest go on."""
        cause = failed.__cause__
        logger.error(
            "the model call failed; failing the %d request(s) of this step: %r",
            len(failed.request_ids),
            cause,
            exc_info=cause,
        )
        error = EngineError(f"the engine failed while running this request: {cause!r}")
        for request_id in failed.request_ids:
            self.engine.abort(request_id)
            self._deliver(request_id, error)

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _ResetPeak):
            self.engine.block_manager.reset_peak()
            return
        if isinstance(command, _Fail):
            raise EngineDead(command.reason)
        if isinstance(command, _Abort):
            output = self.engine.abort(command.request_id)
            if output is not None:
                self._deliver(command.request_id, output)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.sampling)
        except InvalidRequest as exc:
            self._deliver(command.request_id, exc)

    def _stream_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def _deliver(self, request_id: str, item: GenerationOutput | BaseException) -> None:
        """Hand an output (or an error) to the request's event loop; the last one
        unregisters the request."""
        done = isinstance(item, BaseException) or item.finished
        with self._lock:
            stream = self._streams.pop(request_id) if done else self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass
