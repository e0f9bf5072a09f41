"""``AsyncEngine``: the ``Engine`` surface (llmctl/backend.py) around ``LLMEngine``.

One background thread owns the ``LLMEngine``: it takes new requests and aborts from a
command queue, runs steps while there is work (torch releases the GIL while it
computes, so the event loop stays responsive) and sleeps when there is none.

Outputs travel per step, not per request. ``generate`` streams one request to an
asyncio consumer: after a step the engine thread makes one thread-safe call per event
loop that has requests in it, carrying all of that loop's outputs, and there each
request's consumer picks its own. ``generate_all`` (what ``LLM.generate`` and the
throughput benchmark use) runs many requests for a caller that blocks until they end:
the engine thread appends each step's outputs to the caller's lists and wakes it once,
at the end, so no thread switch happens per step.

Faults: a model call that raises fails the requests of its step with ``EngineError``
and the engine goes on. Several failed steps in a row mean the model itself is broken
(a lost GPU, say), and any other exception may have left the engine's own state
inconsistent: then the engine stops, fails everything in flight and ``is_alive()``
turns false, which the server reports as 503. ``EngineDead`` from the runner (a
tensor-parallel rank lost) or ``fail`` stops it the same way at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from time import perf_counter

from llmctl.backend import (
    EngineCapabilities,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    TokenLogprob,
)
from llmctl.engine.llm_engine import LLMEngine, StepFailed
from llmctl.engine.lora import LoraSlots, read_lora
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.step_profile import SpeculationStats, StepProfile
from llmctl.errors import EngineDead, EngineError, InvalidRequest, ModelError
from llmctl.model.lora import AdapterSpec, check_lora_name

logger = logging.getLogger("llmctl")

MAX_FAILED_STEPS_IN_A_ROW = 3

Item = GenerationOutput | BaseException


async def stream_until_finished(
    take: Callable[[], Awaitable[Iterable[Item]]], abort: Callable[[], None]
) -> AsyncIterator[GenerationOutput]:
    """A request's outputs as ``generate`` streams them, from ``take()`` (the items that
    have arrived, waiting while there are none) up to the finished one. An exception item
    is raised; leaving before the end (a client gone, a cancelled task) calls ``abort``.
    Shared by every engine that hands outputs over from a thread of its own (the
    transformers plugin too)."""
    finished = False
    try:
        while not finished:
            for item in await take():
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
    finally:
        if not finished:
            abort()


async def joined(thread: threading.Thread) -> None:
    """Wait for ``thread`` to end without blocking the event loop. It polls rather than
    join on ``asyncio.to_thread``: shutdowns use it, and an ``LLM`` dropped at interpreter
    exit is shut down by its finalizer after Python has closed its thread pools to work."""
    while thread.is_alive():
        await asyncio.sleep(0.005)


class _Stream:
    """What one asyncio consumer receives: items appended on its event loop, and the
    future it waits on while there are none."""

    __slots__ = ("loop", "items", "waiter", "key")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.key = loop  # ``_deliver`` makes one call per event loop
        self.items: list[Item] = []
        self.waiter: asyncio.Future | None = None

    async def take(self) -> list[Item]:
        """Everything received since the last call; waits if nothing is there."""
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


def _dispatch(batch: list[tuple[_Stream, Item]]) -> None:
    """On an event loop: give each stream its items, then wake each consumer once."""
    for stream, item in batch:
        stream.items.append(item)
    for stream, _ in batch:
        waiter = stream.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Joined:
    """What one request of a ``generate_all`` call produced so far."""

    __slots__ = (
        "texts",
        "token_ids",
        "logprobs",
        "prompt_token_ids",
        "cached_tokens",
        "prompt_logprobs",
        "last",
    )

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_token_ids: list[int] | None = None
        self.cached_tokens: int | None = None
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.last: GenerationOutput | None = None


class _Collector:
    """The requests of one blocking ``generate_all`` call. The engine thread joins each
    request's outputs as they come (keeping a step's output objects would leave tens of
    thousands of them for the garbage collector to walk, in pauses that land in the
    middle of steps) and sets ``done`` when the last one finished (or one failed)."""

    def __init__(
        self, request_ids: list[str], on_outputs: Callable[[list[GenerationOutput]], None] | None
    ) -> None:
        self.unfinished = set(request_ids)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._on_outputs = on_outputs
        self._joined = {request_id: _Joined() for request_id in request_ids}

    @property
    def key(self) -> _Collector:
        """``_deliver`` makes one call per collector. A property, not an attribute: a
        collector referring to itself would be a cycle, and every call's outputs (about
        1,400 objects for 256 requests) would stay in memory until a full collection of
        the garbage collector found them."""
        return self

    def receive(self, batch: list[tuple[_Collector, Item]]) -> None:
        """In the engine thread: one step's items for these requests. This runs once per
        request per step, so it does one dictionary look-up per output."""
        received = []
        joined = self._joined
        for _, item in batch:
            if isinstance(item, BaseException):
                self.error = self.error or item
                continue
            record = joined[item.request_id]
            record.texts.append(item.text)
            record.token_ids += item.token_ids
            if item.logprobs:
                record.logprobs += item.logprobs
            if item.prompt_token_ids is not None:
                record.prompt_token_ids = item.prompt_token_ids
            if item.cached_tokens is not None:
                record.cached_tokens = item.cached_tokens
            if item.prompt_logprobs is not None:
                record.prompt_logprobs = item.prompt_logprobs
            record.last = item
            received.append(item)
            if item.finished:
                self.unfinished.discard(item.request_id)
        if self._on_outputs is not None and received:
            self._on_outputs(received)
        if self.error is not None or not self.unfinished:
            self.done.set()

    def result(self, request_id: str) -> GenerationOutput:
        """Everything ``request_id`` produced, as one output."""
        record = self._joined[request_id]
        last = record.last
        return GenerationOutput(
            request_id=request_id,
            text="".join(record.texts),
            token_ids=record.token_ids,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            finished=last.finished,
            finish_reason=last.finish_reason,
            logprobs=record.logprobs or None,
            prompt_token_ids=record.prompt_token_ids,
            cached_tokens=record.cached_tokens,
            prompt_logprobs=record.prompt_logprobs,
        )


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lora: str | None = None
    stream_interval: int = 1


@dataclass
class _LoadLora:
    """Register an adapter whose weights were read off the engine thread."""

    name: str
    spec: AdapterSpec
    weights: object
    done: Future


@dataclass
class _UnloadLora:
    """Retire an adapter; ``done`` is set once its requests have finished."""

    name: str
    done: Future


@dataclass
class _Abort:
    request_id: str


class _ResetPeak:
    """Start a new high-water mark of KV blocks in use."""


@dataclass
class _Fail:
    """Stop for good: the engine cannot run any more (see ``fail``)."""

    reason: str


Command = _Add | _Abort | _ResetPeak | _Fail | _LoadLora | _UnloadLora


def freeze_heap() -> None:
    """Take every object alive now out of the garbage collector's full collections
    (``gc.freeze``), as vLLM's engine does once it has started. After loading, the heap
    holds ~190,000 tracked objects (torch, transformers, the tokenizer), and a full
    collection walks them all: ~90 ms on this CPU, which came once every dozen
    ``generate`` calls of 256 requests, a pause in a step of every request in flight.
    Garbage is collected first, so none is kept. An engine's shutdown unfreezes the heap
    (``gc.unfreeze``): what became garbage in cycles meanwhile, the engine's own
    included, is collected again."""
    gc.collect()
    gc.freeze()


class AsyncEngine(EngineCapabilities):
    can_generate_all = True
    has_step_loop = True

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._lock = threading.Condition()  # guards the four fields below
        self._commands: list[Command] = []
        self._streams: dict[str, _Stream | _Collector] = {}  # where each request's outputs go
        self._stopping = False
        self.failure: BaseException | None = None  # why the engine stopped by itself
        # Engine thread only: steps' outputs, and other items by request id (errors and
        # aborts, which come after any output of their request: delivered after them).
        self._undelivered_outputs: list[GenerationOutput] = []
        self._undelivered: list[tuple[str, Item]] = []
        self._thread = threading.Thread(target=self._run, name="llmctl-engine", daemon=True)
        freeze_heap()
        self._thread.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream a request's outputs; ``InvalidRequest`` before the first one if refused.

        Leaving the iteration early (a client disconnecting, a cancelled task) aborts the
        request, which frees its KV blocks.
        """
        stream = _Stream(asyncio.get_running_loop())
        if request.sampling.structured is not None:
            # Compiled on the grammar thread (the first one also imports xgrammar, which
            # takes a second: off the event loop too); its errors are refusals.
            await asyncio.wrap_future(await asyncio.to_thread(self._compile, request))
        self._register([request], stream)
        abort = partial(self._submit, _Abort(request.request_id))
        async with aclosing(stream_until_finished(stream.take, abort)) as outputs:
            async for output in outputs:
                yield output

    def generate_all(
        self,
        requests: Sequence[GenerationRequest],
        on_outputs: Callable[[list[GenerationOutput]], None] | None = None,
    ) -> list[GenerationOutput]:
        """Run ``requests`` together and block until all have finished; return, in
        request order, everything each one produced as one output (its text and tokens
        joined). ``on_outputs`` is called in the engine thread with each step's outputs
        (to show progress; it must be quick). ``InvalidRequest`` before anything runs if
        one is refused; an error, or an interrupt, aborts the requests still running."""
        if not requests:  # nothing to wait for: the collector would never be done
            return []
        collector = _Collector([request.request_id for request in requests], on_outputs)
        for grammar in [self._compile(request) for request in requests]:
            if grammar is not None:
                grammar.result()
        self._register(requests, collector)
        try:
            collector.done.wait()
        finally:
            unfinished = list(collector.unfinished)  # the engine thread may still change it
            if unfinished:
                self._submit(*(_Abort(request_id) for request_id in unfinished))
        if collector.error is not None:
            raise collector.error
        return [collector.result(request.request_id) for request in requests]

    def _compile(self, request: GenerationRequest) -> Future | None:
        """Start compiling the request's grammar (cached by spec), so that it never
        compiles in the step loop and a bad one is refused before the request runs."""
        spec = request.sampling.structured
        return None if spec is None else self.engine.grammars.compile(spec)

    def _register(
        self, requests: Sequence[GenerationRequest], target: _Stream | _Collector
    ) -> None:
        """Check ``requests`` and queue them, their outputs going to ``target``."""
        prompts = [self._prompt_token_ids(request) for request in requests]
        for request, prompt_ids in zip(requests, prompts):
            self.engine.validate(prompt_ids, request.sampling)
            self.engine.lora_adapter(request.lora)  # an unknown one is refused here
        with self._lock:
            if isinstance(self.failure, EngineDead):
                raise EngineDead(str(self.failure))
            if self.failure is not None:
                raise EngineError(f"the engine has stopped after a failure: {self.failure}")
            if self._stopping:
                raise EngineError("the engine has been shut down")
            seen = set()
            for request in requests:
                if request.request_id in self._streams or request.request_id in seen:
                    raise InvalidRequest(f"request id {request.request_id!r} is already in use")
                seen.add(request.request_id)
            for request, prompt_ids in zip(requests, prompts):
                self._streams[request.request_id] = target
                self._commands.append(
                    _Add(
                        request.request_id,
                        prompt_ids,
                        request.sampling,
                        request.lora,
                        request.stream_interval,
                    )
                )
            self._lock.notify()

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
        speculator = self.engine.speculator
        spec = speculator.stats if speculator is not None else SpeculationStats()
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + pending,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_peak=blocks.peak_used_blocks,
            block_size=blocks.block_size,
            tensor_parallel_size=self.engine.runner.tensor_parallel_size,
            spec_proposed=spec.proposed,
            spec_accepted=spec.accepted,
            spec_proposed_by_position=tuple(spec.proposed_at),
            spec_accepted_by_position=tuple(spec.accepted_at),
        )

    @property
    def serves_lora(self) -> bool:  # type: ignore[override]
        """Where the runner does (the torch backend's, unsharded)."""
        return self.engine.loras is not None

    def lora_names(self) -> tuple[str, ...]:
        loras = self.engine.loras
        return () if loras is None else loras.names

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name``, from the next step on; requests in
        flight are not disturbed (the files are read on another thread). ``ModelError``
        names what is wrong with the adapter or the name."""
        spec, weights = await asyncio.to_thread(self._read_lora, name, path)
        done: Future = Future()
        self._submit(_LoadLora(name, spec, weights, done))
        await asyncio.wrap_future(done)

    def load_lora_now(self, name: str, path: str) -> None:
        """``load_lora`` for a blocking caller (the adapters served from the start)."""
        spec, weights = self._read_lora(name, path)
        done: Future = Future()
        self._submit(_LoadLora(name, spec, weights, done))
        done.result()

    async def unload_lora(self, name: str) -> None:
        """Stop serving ``name`` at once (new requests for it are refused as an unknown
        model); returns once the requests already using it have finished and its memory
        is freed. ``KeyError`` if no adapter has that name."""
        done: Future = Future()
        self._submit(_UnloadLora(name, done))
        await asyncio.wrap_future(done)

    def _loras(self) -> LoraSlots:
        if self.engine.loras is None:
            raise ModelError(
                "this engine serves no LoRA adapters: use --backend torch, or turbo on the CPU"
            )
        return self.engine.loras

    def _read_lora(self, name: str, path: str) -> tuple[AdapterSpec, object]:
        loras = self._loras()
        check_lora_name(name, set(loras.names), self.model_name)
        return read_lora(loras.runner, path, loras.runner.base_config)

    def reset_peak_kv_blocks(self) -> None:
        """Start ``stats().kv_blocks_peak`` afresh from here (the bench, after warming up)."""
        self._submit(_ResetPeak())

    def step_profile(self, reset: bool = False) -> StepProfile:
        """Where the engine thread's time went since the last reset (see step_profile.py)."""
        profile = self.engine.profile
        if reset:
            self.engine.profile = StepProfile()
        return profile

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
        await joined(self._thread)
        self.engine.runner.close()  # at shutdown nothing else waits on this loop
        gc.unfreeze()

    def stop_now(self) -> None:
        """``shutdown`` for a blocking caller (an engine whose start failed part-way)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join()
        self.engine.runner.close()
        gc.unfreeze()

    def _prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt)
        return self.tokenizer.encode_chat(
            request.messages, tools=request.tools, template_kwargs=request.chat_template_kwargs
        )

    def _submit(self, *commands: Command) -> None:
        with self._lock:
            self._commands.extend(commands)
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
            self._flush()
            self._deliver([(request_id, error) for request_id in self._stream_ids()])
            return
        for request_id in self._stream_ids():
            output = self.engine.abort(request_id)
            if output is not None:
                self._undelivered.append((request_id, output))
        self._flush()

    def _loop(self) -> None:
        """Apply commands, step while there is work, sleep otherwise; until shutdown.

        A step's outputs are handed over just before the next step's model call (or at
        once when no step follows), so the event loops take them while the model runs."""
        engine = self.engine
        failed_in_a_row = 0
        while True:
            if not (self._commands or engine.has_unfinished()):
                self._flush()
            waited = perf_counter()
            with self._lock:
                while not (self._commands or self._stopping or engine.has_unfinished()):
                    self._lock.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            engine.profile.idle += perf_counter() - waited
            for command in commands:
                self._undelivered += self._apply(command)
            if stopping:
                return
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step(before_model=self._flush)
            except StepFailed as failed:
                if isinstance(failed.__cause__, EngineDead):
                    raise failed.__cause__ from None
                failed_in_a_row += 1
                self._undelivered += [(output.request_id, output) for output in failed.outputs]
                if failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                    raise RuntimeError(
                        f"{failed_in_a_row} model calls failed in a row, the last with: "
                        f"{failed.__cause__!r}"
                    ) from failed.__cause__
                self._fail_step(failed)
                continue
            failed_in_a_row = 0
            self._undelivered_outputs += outputs

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
            self._undelivered.append((request_id, error))
        self._flush()

    def _flush(self) -> None:
        """Deliver what the engine thread has collected."""
        if self._undelivered or self._undelivered_outputs:
            started = perf_counter()
            outputs, self._undelivered_outputs = self._undelivered_outputs, []
            items, self._undelivered = self._undelivered, []
            self._deliver(items, outputs)
            self.engine.profile.deliver += perf_counter() - started

    def _apply(self, command: Command) -> list[tuple[str, Item]]:
        if isinstance(command, _ResetPeak):
            self.engine.block_manager.reset_peak()
            return []
        if isinstance(command, _Fail):
            raise EngineDead(command.reason)
        if isinstance(command, _Abort):
            output = self.engine.abort(command.request_id)
            return [] if output is None else [(command.request_id, output)]
        if isinstance(command, (_LoadLora, _UnloadLora)):
            self._apply_lora(command)
            return []
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.sampling,
                command.lora,
                stream_interval=command.stream_interval,
            )
        except InvalidRequest as exc:
            return [(command.request_id, exc)]
        return []

    def _apply_lora(self, command: _LoadLora | _UnloadLora) -> None:
        loras, done = self.engine.loras, command.done
        try:
            if isinstance(command, _LoadLora):
                loras.register(command.name, command.spec, command.weights)
                done.set_result(None)
            else:
                loras.retire(command.name, on_freed=lambda: done.set_result(None))
        except (ModelError, KeyError) as exc:
            done.set_exception(exc)

    def _stream_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def _deliver(
        self, items: list[tuple[str, Item]], outputs: Sequence[GenerationOutput] = ()
    ) -> None:
        """Hand ``outputs``, then other items (errors, by request id) over: one call per
        event loop, one per blocking caller. A request's last one unregisters it. This
        runs once per request per step: a dictionary look-up and an append for each."""
        if not (items or outputs):
            return
        batches: dict[object, list[tuple[_Stream | _Collector, Item]]] = {}
        last_key, last_batch = None, None
        with self._lock:
            streams = self._streams
            for output in outputs:
                request_id = output.request_id
                target = (
                    streams.pop(request_id, None) if output.finished else streams.get(request_id)
                )
                if target is None:
                    continue
                if target.key is not last_key:  # most steps' outputs all go to one place
                    last_key = target.key
                    last_batch = batches.setdefault(last_key, [])
                last_batch.append((target, output))
            for request_id, item in items:
                done = isinstance(item, BaseException) or item.finished
                target = streams.pop(request_id, None) if done else streams.get(request_id)
                if target is not None:
                    batches.setdefault(target.key, []).append((target, item))
        for key, batch in batches.items():
            if isinstance(key, _Collector):
                key.receive(batch)
                continue
            try:
                key.call_soon_threadsafe(_dispatch, batch)
            except RuntimeError:  # its event loop is closed: nobody is listening any more
                pass
