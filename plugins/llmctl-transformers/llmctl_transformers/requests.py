"""llmctl's side of a request to the transformers backend, shared by its two engines
(continuous batching and plain ``generate``): ``admit`` refuses what transformers cannot
honour and what does not fit, and ``RequestState`` turns its tokens into outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import partial

from llmctl.backend import EngineCapabilities, GenerationOutput, GenerationRequest
from llmctl.engine.async_engine import stream_until_finished
from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.sequence import finish_reason, stop_token_ids, validate_request
from llmctl.errors import InvalidRequest
from llmctl.model.tokenizer import Tokenizer
from llmctl_transformers.sampling import unsupported


def admit(
    request: GenerationRequest,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
) -> RequestState:
    """llmctl's side of a new request, after refusing what transformers cannot honour and
    what does not fit (``InvalidRequest``). Shared with ``PlainGenerateEngine``."""
    if problems := unsupported(request.sampling):
        raise InvalidRequest(
            "the transformers backend cannot honour " + "; ".join(problems) + ". Leave "
            "these at their defaults, or serve the model with another backend"
        )
    if request.prompt_token_ids is not None:
        prompt_ids = list(request.prompt_token_ids)
    elif request.prompt is not None:
        prompt_ids = tokenizer.encode(request.prompt)
    else:
        prompt_ids = tokenizer.encode_chat(
            request.messages, tools=request.tools, template_kwargs=request.chat_template_kwargs
        )
    sampling = request.sampling
    validate_request(
        prompt_ids,
        sampling,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
    )
    if sampling.max_tokens is None:  # "until the session is full"
        sampling = replace(sampling, max_tokens=max_model_len - len(prompt_ids))
    return RequestState(
        request.request_id,
        asyncio.get_running_loop(),
        prompt_ids,
        sampling,
        IncrementalDetokenizer(tokenizer, prompt_ids, sampling),
        stop_token_ids(sampling, tokenizer.eos_token_ids),
    )


@dataclass
class RequestState:
    """llmctl's side of one request: where its outputs go, and its text so far."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    prompt_token_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int]  # the ids that end it (sequence.stop_token_ids)
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0

    async def stream(self, abort: Callable[[], None]) -> AsyncIterator[GenerationOutput]:
        """The request's outputs as its engine delivers them, until it finishes;
        ``abort()`` if the consumer leaves first (``stream_until_finished``)."""

        async def take() -> list[GenerationOutput | BaseException]:
            return [await self.outputs.get()]

        async with aclosing(stream_until_finished(take, abort)) as outputs:
            async for output in outputs:
                yield output

    def advance(self, token_id: int) -> GenerationOutput:
        """The delta for one more generated token; ``finished`` if it ends the request."""
        self.num_output_tokens += 1
        reason = finish_reason(
            token_id, self.num_output_tokens, self.sampling, self.stop_ids, self.detokenizer
        )
        return self._output(
            self.detokenizer.take_new_text(final=reason is not None), [token_id], reason
        )

    def ended(self, reason: str) -> GenerationOutput:
        """The last delta of a request transformers ended at a limit it was given."""
        return self._output(self.detokenizer.take_new_text(final=True), [], reason)

    def aborted(self) -> GenerationOutput:
        nothing_streamed = self.num_output_tokens == 0
        return GenerationOutput.aborted(
            self.request_id,
            len(self.prompt_token_ids),
            self.num_output_tokens,
            prompt_token_ids=self.prompt_token_ids if nothing_streamed else None,
        )

    def _output(self, text: str, token_ids: list[int], reason: str | None) -> GenerationOutput:
        first = self.num_output_tokens == len(token_ids)  # nothing was streamed before
        return GenerationOutput(
            request_id=self.request_id,
            text=text,
            token_ids=token_ids,
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=self.num_output_tokens,
            finished=reason is not None,
            finish_reason=reason,
            prompt_token_ids=self.prompt_token_ids if first else None,
        )


class RequestEngine(EngineCapabilities):
    """What the plugin's two engines share: a request is admitted against the engine's
    limits (``admit``), handed to it (``_submit``) and streamed until it ends; leaving
    the stream early (a client disconnecting) aborts it (``_abort``), which frees what
    it holds. ``block_size`` and ``num_blocks`` bound a request by the KV cache (1 and
    the session length where there is no paged cache)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream a request's outputs; ``InvalidRequest`` before the first one if refused."""
        state = admit(
            request,
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
        )
        self._submit(state)
        async with aclosing(state.stream(partial(self._abort, request.request_id))) as outputs:
            async for output in outputs:
                yield output

    @property
    def has_chat_template(self) -> bool:
        """Whether ``messages`` go through a chat template (else their contents are joined)."""
        return self.tokenizer.has_chat_template

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _submit(self, state: RequestState) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError
