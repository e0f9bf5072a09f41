"""Translate between llmctl's generation types and the OpenAI wire format.

Requests go upstream always streaming (with ``stream_options.include_usage`` so the last
event carries exact token counts); the engine turns each event into a
``GenerationOutput``, whether the proxy's own client asked to stream or not.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from llmctl.backend import GenerationOutput, GenerationRequest, SamplingParams, TokenLogprob
from llmctl.engine.sampling_params import StructuredOutput
from llmctl.errors import InvalidRequest, UpstreamError

# The upstream speaks text, not this process's token ids: they are unknown here.
UNKNOWN_TOKEN_ID = -1

# Fields every OpenAI-compatible server knows. The others (vLLM's and llmctl's
# extensions) are sent only when they differ from SamplingParams' neutral default, so a
# server that rejects unknown fields still works for every request that does not use them.
STANDARD_FIELDS = ("max_tokens", "temperature", "top_p")
EXTENSION_FIELDS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
_NEUTRAL = SamplingParams()


def upstream_request(request: GenerationRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The path (under ``/v1``) and JSON body that ask the upstream for ``request``."""
    sampling = request.sampling
    if request.tools or (sampling.structured and sampling.structured.kind == "structural_tag"):
        raise InvalidRequest(
            "the openai-proxy backend does not forward tools yet (their calls would come "
            "back unread); send the request to the upstream server itself",
            param="tools",
            code="invalid_combination",
        )
    if sampling.prompt_logprobs is not None:
        raise InvalidRequest(
            "the openai-proxy backend does not forward prompt logprobs (echo with logprobs, "
            "prompt_logprobs) yet: the upstream's would come back unread; send the request "
            "to the upstream server itself",
            param="prompt_logprobs",
            code="invalid_combination",
        )
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update({name: getattr(sampling, name) for name in STANDARD_FIELDS})
    for name in EXTENSION_FIELDS:
        value = getattr(sampling, name)
        if value != getattr(_NEUTRAL, name):
            body[name] = value
    if sampling.logit_bias:
        body["logit_bias"] = {str(token_id): bias for token_id, bias in sampling.logit_bias.items()}
    if sampling.structured is not None:
        body.update(_structured_fields(sampling.structured))
    if request.messages is not None:
        body["messages"] = request.messages
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = request.chat_template_kwargs
        if sampling.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = sampling.top_logprobs
        return "/chat/completions", body
    body["prompt"] = request.prompt if request.prompt is not None else request.prompt_token_ids
    if sampling.logprobs:
        body["logprobs"] = sampling.top_logprobs  # the legacy API's "how many alternatives"
    return "/completions", body


def _structured_fields(spec: StructuredOutput) -> dict[str, Any]:
    """A grammar in the upstream's terms: OpenAI's ``response_format`` for JSON, vLLM's
    ``structured_outputs`` for the rest (an upstream without it refuses it by name)."""
    if spec.kind == "json":
        return {"response_format": {"type": "json_object"}}
    if spec.kind == "json_schema":
        schema = json.loads(spec.value)
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "response", "schema": schema, "strict": True},
            }
        }
    if spec.kind == "choice":
        return {"structured_outputs": {"choice": json.loads(spec.value)}}
    grammar = spec.kind in ("ebnf", "lark")  # vLLM's one field for both
    return {"structured_outputs": {"grammar" if grammar else spec.kind: spec.value}}


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` payload of each server-sent event (multi-line data joined by newlines)."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:  # a blank line ends an event
            yield "\n".join(data)
            data = []
        # `event:`, `id:`, `retry:` and `:` comment lines carry nothing the proxy needs
    if data:
        yield "\n".join(data)


class StreamTranslator:
    """Turns one upstream stream's events into ``GenerationOutput`` deltas.

    The event that carries ``finish_reason`` is held back until the stream ends, because
    the exact token counts (``usage``) come in a later event of their own.
    """

    def __init__(self, request_id: str, chat: bool) -> None:
        self.request_id = request_id
        self.chat = chat
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._last: GenerationOutput | None = None  # the held-back final delta

    def feed(self, payload: str) -> GenerationOutput | None:
        """One event's JSON; returns the delta to stream now, if any."""
        try:
            event = json.loads(payload)
        except ValueError:
            raise UpstreamError(
                f"upstream sent an event that is not JSON: {payload[:200]!r}"
            ) from None
        if not isinstance(event, dict):
            raise UpstreamError(f"upstream sent an unexpected event: {payload[:200]!r}")
        if event.get("error") or event.get("object") == "error":  # failed after streaming began
            error = event.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            raise UpstreamError(f"upstream failed mid-stream: {message or event.get('message')}")
        if usage := event.get("usage"):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        choices = event.get("choices") or []
        if not choices:
            return None
        choice = choices[0]  # the proxy always asks for one choice (n=1)
        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
        logprobs = self._logprobs(choice.get("logprobs"))
        if logprobs is not None:  # exact: one entry per generated token
            self.completion_tokens += len(logprobs)
        elif text:  # an estimate until `usage` arrives: servers send one token per event
            self.completion_tokens += 1
        output = GenerationOutput(
            self.request_id,
            text=text or "",
            token_ids=[],
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            logprobs=logprobs,
        )
        if choice.get("finish_reason") is not None:
            output.finished = True
            output.finish_reason = choice["finish_reason"]
            self._last = output
            return None
        return output if (output.text or logprobs) else None

    def finish(self) -> GenerationOutput:
        """The final delta, with the upstream's exact token counts."""
        if self._last is None:
            raise UpstreamError("upstream closed the stream before the generation finished")
        self._last.prompt_tokens = self.prompt_tokens
        self._last.completion_tokens = self.completion_tokens
        return self._last

    def aborted(self) -> GenerationOutput:
        return GenerationOutput.aborted(self.request_id, self.prompt_tokens, self.completion_tokens)

    def _logprobs(self, raw: dict[str, Any] | None) -> list[TokenLogprob] | None:
        if not raw:
            return None
        if self.chat:  # {"content": [{"token", "logprob", "top_logprobs": [...]}, ...]}
            return [
                TokenLogprob(
                    UNKNOWN_TOKEN_ID,
                    entry["token"],
                    entry["logprob"],
                    [
                        (UNKNOWN_TOKEN_ID, t["token"], t["logprob"])
                        for t in entry.get("top_logprobs") or []
                    ],
                )
                for entry in raw.get("content") or []
            ]
        # legacy completions: parallel lists, alternatives as {token: logprob} dicts
        tops = raw.get("top_logprobs") or [None] * len(raw.get("tokens", []))
        return [
            TokenLogprob(
                UNKNOWN_TOKEN_ID,
                token,
                logprob,
                [(UNKNOWN_TOKEN_ID, t, lp) for t, lp in (top or {}).items()],
            )
            for token, logprob, top in zip(
                raw.get("tokens", []), raw.get("token_logprobs", []), tops
            )
        ]
