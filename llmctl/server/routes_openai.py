"""``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

Each generation request goes the same way: check the body, turn it into one engine
request per choice, wait for a generation slot (or get 429), start the engine requests
(a refusal is a 400), then stream Server-Sent Events or answer the whole result. Values
that do not go together raise ``InvalidRequest`` naming the field, which the error
handlers answer with a 400 whose ``param`` is that field.

``GenerationStream`` runs the engine requests of one HTTP request together and merges
their outputs. An HTTP request becomes one engine request per choice (``n`` per
prompt, several prompts for a batched completion). They are all submitted at once so
the engine batches them; ``start`` waits until each has produced its first output, so a request the engine
refuses (too long, say) still becomes a 400 before any response has been sent.
``close`` aborts whatever is still running, which frees its KV blocks: it runs however
the response ends (finished, client gone, server shutting down).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from llmctl.backend import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    capabilities,
)
from llmctl.errors import InvalidRequest, LlmctlError
from llmctl.server.errors import APIError, api_error_for
from llmctl.server.metrics import ServerMetrics
from llmctl.server.openai_format import ChatFormatter, ChoiceProgress, CompletionFormatter
from llmctl.server.openapi import (
    GATE_ERRORS,
    GENERATION_ERRORS,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ModelList,
    error_responses,
    streamed_or_whole,
)
from llmctl.server.protocol import ChatCompletionRequest, CompletionRequest
from llmctl.server.reasoning import CLOSE as REASONING_CLOSE
from llmctl.server.reasoning import opens_reasoning
from llmctl.server.state import ServerState
from llmctl.server.streaming import ClientGone, EventStreamResponse, sse_event, unless_disconnected
from llmctl.server.tool_parsers import family_for_template

log = logging.getLogger("llmctl.server")

router = APIRouter(prefix="/v1")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first"
# A response sent whole needs no output per token: the engine hands this many at once
# (GenerationRequest.stream_interval), often enough that /metrics' token counts stay live.
WHOLE_RESPONSE_INTERVAL = 16

Formatter = CompletionFormatter | ChatFormatter


def _state(request: Request) -> ServerState:
    return request.app.state.llmctl


@router.get("/models", response_model=ModelList, responses=error_responses(*GATE_ERRORS))
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    base = state.engine.model_name
    model = {
        "id": base,
        "object": "model",
        "created": state.started_at,
        "owned_by": "llmctl",
        "max_model_len": state.engine.max_model_len or None,  # 0: not known (a proxy)
        "chat_template": capabilities(state.engine).has_chat_template,
    }
    adapters = [
        {**model, "id": name, "parent": base} for name in capabilities(state.engine).lora_names()
    ]
    return {"object": "list", "data": [model, *adapters]}


@router.post(
    "/completions",
    responses=streamed_or_whole(Completion, CompletionChunk) | error_responses(*GENERATION_ERRORS),
)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    lora = state.check_model(body.model)
    _check_session_bounds(state, body)
    prompts = body.prompts()
    response_id = f"cmpl-{uuid.uuid4().hex}"
    requests = _engine_requests(
        response_id, prompts, body.sampling_params(), body.n, lora, body.stream
    )
    echoes = [_prompt_text(state, p) for p in prompts for _ in range(body.n)] if body.echo else None
    formatter = CompletionFormatter(
        response_id,
        lora or state.engine.model_name,
        body.include_usage,
        len(requests),
        echoes,
        echo_logprobs=body.echo and body.logprobs is not None,
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    return await _respond(request, state, body, requests, formatter)


@router.post(
    "/chat/completions",
    responses=streamed_or_whole(ChatCompletion, ChatCompletionChunk)
    | error_responses(*GENERATION_ERRORS),
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    lora = state.check_model(body.model)
    _check_session_bounds(state, body)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    prompt = {
        "messages": body.engine_messages(),
        "tools": body.template_tools(),
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    sampling = body.sampling_params()
    template = state.chat_template()
    family = None
    if body.calls_tools:
        family = state.config.tool_call_parser
        if family == "auto":
            family = family_for_template(template)
        sampling = body.tool_sampling(sampling, family)
    requests = _engine_requests(response_id, [prompt], sampling, body.n, lora, body.stream)
    reasoning = template is not None and REASONING_CLOSE in template
    formatter = ChatFormatter(
        response_id,
        lora or state.engine.model_name,
        body.include_usage,
        len(requests),
        tool_family=family,
        reasoning=reasoning,
        in_reasoning=reasoning and _prompt_opens_reasoning(state, prompt),
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    return await _respond(request, state, body, requests, formatter)


def _prompt_opens_reasoning(state: ServerState, prompt: dict[str, Any]) -> bool:
    """Whether the chat prompt ends inside ``<think>`` (DeepSeek-R1, QwQ): rendered here
    as the engine renders it (a template that refuses the messages is the same 400)."""
    text = state.engine.tokenizer.apply_chat_template(
        prompt["messages"], True, prompt["tools"], prompt["chat_template_kwargs"]
    )
    return opens_reasoning(text)


def _prompt_text(state: ServerState, prompt: dict[str, Any]) -> str:
    """A prompt as ``echo`` repeats it: its text, or its token ids decoded."""
    if "prompt" in prompt:
        return prompt["prompt"]
    tokenizer = capabilities(state.engine).tokenizer
    if tokenizer is None:
        raise InvalidRequest(
            "echo of a token-id prompt needs the model's tokenizer, which this backend "
            "does not have here; send the prompt as text",
            param="echo",
            code="invalid_combination",
        )
    return tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)


def _check_session_bounds(state: ServerState, body: CompletionRequest | ChatCompletionRequest):
    """No token count may exceed the session length: the bound /openapi.json publishes,
    kept even for a field another one overrides (max_tokens beside max_completion_tokens)."""
    limit = state.engine.max_model_len  # 0: not known here (a proxy checks upstream)
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = getattr(body, field, None)
        if limit and value is not None and value > limit:
            raise InvalidRequest(
                f"{field} ({value}) is more than session_len {limit}, which the prompt "
                f"shares: lower {field}",
                param=field,
                code="invalid_value",
            )


def _engine_requests(
    response_id: str,
    prompts: list[dict[str, Any]],
    sampling: SamplingParams,
    n: int,
    lora: str | None = None,
    stream: bool = True,
) -> list[GenerationRequest]:
    """``n`` engine requests per prompt (``SamplingParams.choices``: choice ``j`` of a
    seeded request uses seed + j), with the LoRA adapter ``lora`` if any, ids in choice
    order; a response not streamed takes its outputs in fewer, larger pieces."""
    choices = dataclasses.replace(sampling, n=n).choices()
    requests = []
    for prompt in prompts:
        for params in choices:
            index = len(requests)
            requests.append(
                GenerationRequest(
                    request_id=f"{response_id}-{index}",
                    sampling=params,
                    lora=lora,
                    stream_interval=1 if stream else WHOLE_RESPONSE_INTERVAL,
                    **prompt,
                )
            )
    return requests


async def _respond(
    request: Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    requests: list[GenerationRequest],
    formatter: Formatter,
) -> Response:
    """Run ``requests`` (the ``n`` choices of ``body``'s prompts) and answer, streamed
    or whole as ``body`` asks."""
    n, grammar_param = body.n, body.structured_param
    arrived_at = time.monotonic()
    _log_start(state, formatter.id, requests)
    try:
        generation = await unless_disconnected(
            request, _begin(state, requests, arrived_at, grammar_param)
        )
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def finish() -> None:
        await generation.close()
        state.admission.release()
        _log_end(state, formatter.id, generation, n)

    if body.stream:
        return EventStreamResponse(
            _events(generation, formatter, n, body.continuous_usage),
            on_close=finish,
            send_timeout=state.config.client_timeout,
        )
    try:
        result = await unless_disconnected(request, _collect(generation, formatter, n))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await finish()
    return JSONResponse(result)


# The codes of the engine's refusals of a grammar (engine/grammar.py).
GRAMMAR_ERRORS = ("invalid_grammar", "unsupported_grammar")


async def _begin(
    state: ServerState,
    requests: list[GenerationRequest],
    arrived_at: float,
    grammar_param: str | None = None,
) -> GenerationStream:
    """Take a generation slot (or 429), then start the engine requests (or their error)."""
    await state.admission.acquire()
    try:
        return await GenerationStream.start(state.engine, requests, state.metrics, arrived_at)
    except InvalidRequest as exc:
        state.admission.release()
        if exc.param is None and exc.code in GRAMMAR_ERRORS:
            exc.param = grammar_param
        raise
    except BaseException:
        state.admission.release()
        raise


async def _events(
    generation: GenerationStream, formatter: Formatter, n: int, continuous_usage: bool
) -> AsyncIterator[str]:
    sent = [0] * len(generation.requests)  # each choice's tokens in the chunks so far
    try:
        async for index, output in generation.outputs():
            sent[index] = output.completion_tokens
            chunk = formatter.stream_chunk(index, output)
            if chunk is not None:
                if continuous_usage:  # the tokens sent, not those the engine is ahead by
                    usage = generation.usage(n)
                    usage["completion_tokens"] = sum(sent)
                    usage["total_tokens"] = usage["prompt_tokens"] + sum(sent)
                    chunk["usage"] = usage
                yield sse_event(chunk)
        if formatter.include_usage:
            yield sse_event(formatter.usage_chunk(generation.usage(n)))
    except Exception as exc:  # headers are sent: the error travels in the stream
        if not isinstance(exc, (APIError, LlmctlError)):
            log.error("generation %s failed", formatter.id, exc_info=exc)
        error = api_error_for(exc)
        yield sse_event({"error": error.body()})
    yield sse_event("[DONE]")


async def _collect(generation: GenerationStream, formatter: Formatter, n: int) -> dict[str, Any]:
    async for _ in generation.outputs():
        pass  # the stream's progress keeps each choice's text and logprobs
    progress = generation.progress
    return formatter.response(
        [p.text for p in progress], [p.logprobs for p in progress], progress, generation.usage(n)
    )


def _log_start(state: ServerState, response_id: str, requests: list[GenerationRequest]) -> None:
    if state.config.log_prompts:
        first = requests[0]
        prompt = first.prompt if first.prompt is not None else first.prompt_token_ids
        log.info("%s prompt: %r", response_id, prompt if prompt is not None else first.messages)


def _log_end(state: ServerState, response_id: str, generation: GenerationStream, n: int) -> None:
    """Sizes and timing only; the text itself only with log_prompts."""
    progress = generation.progress
    usage = generation.usage(n)
    log.info(
        "%s: %d choice(s), %d prompt + %d generated tokens, finish %s, %.2fs",
        response_id,
        len(progress),
        usage["prompt_tokens"],
        usage["completion_tokens"],
        ",".join(str(p.finish_reason) for p in progress),
        time.monotonic() - generation.arrived_at,
    )
    if state.config.log_prompts:
        for index, p in enumerate(progress):
            log.info("%s choice %d: %r", response_id, index, p.text)


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
