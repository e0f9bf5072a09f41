"""Engine outputs in OpenAI's response shapes: completions and chat, streamed and whole.

A formatter is made per HTTP request and keeps what the stream needs across chunks
(which choices already announced their role, each choice's text offset).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmctl.backend import GenerationOutput, TokenLogprob
from llmctl.server.chat_output import ChoiceReader, whole_message


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


# JSON has no -inf; OpenAI clients expect a number. vLLM uses the same floor.
_MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    """A JSON-safe logprob in [-9999, 0]. Degenerate sampling values (a repetition
    penalty of 1e-300, say) can make the distribution NaN: that reads as the floor."""
    if math.isnan(value):
        return _MIN_LOGPROB
    return min(max(value, _MIN_LOGPROB), 0.0)


class _Formatter:
    object_name: str
    chunk_object_name: str

    def __init__(self, response_id: str, model: str, include_usage: bool) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, choices)
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage}


class CompletionFormatter(_Formatter):
    """``text_completion`` objects, with the legacy logprobs shape. With ``echo`` and
    logprobs (``echo_logprobs``) the prompt's tokens lead each choice's logprobs; with
    ``prompt_logprobs`` each choice also gets vLLM's ``prompt_logprobs`` list."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        response_id: str,
        model: str,
        include_usage: bool,
        num_choices: int,
        echoes: list[str] | None = None,
        *,
        echo_logprobs: bool = False,
        prompt_logprobs: bool = False,
    ):
        super().__init__(response_id, model, include_usage)
        self._text_offsets = [0] * num_choices
        # ``echo``: each choice's prompt text, sent before its first generated text.
        self._echoes = list(echoes) if echoes else [""] * num_choices
        self._echo_logprobs = echo_logprobs
        self._prompt_logprobs = prompt_logprobs

    def stream_chunk(self, index: int, output: GenerationOutput) -> dict[str, Any] | None:
        echo, self._echoes[index] = self._echoes[index], ""
        text = echo + output.text
        if not (text or output.finished or output.logprobs):
            return None
        choice = self._choice(index, text, output.logprobs, output.prompt_logprobs)
        choice["finish_reason"] = output.finish_reason if output.finished else None
        return self._chunk([choice])

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        prompt_logprobs: list[TokenLogprob] | None,
    ) -> dict[str, Any]:
        """A choice's text and logprobs; the prompt's scores lead them where asked (they
        come with a choice's first output only)."""
        if self._echo_logprobs and prompt_logprobs is not None:
            logprobs = prompt_logprobs + (logprobs or [])
        choice = {"index": index, "text": text, "logprobs": self._logprobs(index, logprobs)}
        if self._prompt_logprobs and prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(prompt_logprobs)
        return choice

    def response(
        self,
        texts: Sequence[str],
        logprobs: Sequence[list[TokenLogprob] | None],
        progress: Sequence[ChoiceProgress],
        usage: dict[str, int],
    ) -> dict[str, Any]:
        choices = []
        for index, text in enumerate(texts):
            choice = self._choice(
                index, self._echoes[index] + text, logprobs[index], progress[index].prompt_logprobs
            )
            choice["finish_reason"] = progress[index].finish_reason
            choices.append(choice)
        return {**self._envelope(self.object_name, choices), "usage": usage}

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict | None:
        """``{tokens, token_logprobs, top_logprobs, text_offset}``; offsets continue
        across the chunks of a stream."""
        if entries is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._text_offsets[index])
            self._text_offsets[index] += len(entry.token)
        # The first prompt token (echo) has no logprob: null, as OpenAI and vLLM send it.
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [None if e.logprob is None else _logprob(e.logprob) for e in entries],
            "top_logprobs": [
                None
                if e.logprob is None
                else {e.token: _logprob(e.logprob)} | {tok: _logprob(lp) for _, tok, lp in e.top}
                for e in entries
            ],
            "text_offset": offsets,
        }


def _vllm_prompt_logprobs(entries: list[TokenLogprob]) -> list[dict[str, dict] | None]:
    """vLLM's shape: per prompt token (null for the first), token id -> ``{logprob, rank,
    decoded_token}`` for the prompt's own token and the most likely alternatives."""

    def item(logprob: float, rank: int, token: str) -> dict[str, Any]:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": token}

    scores: list[dict[str, dict] | None] = []
    for entry in entries:
        if entry.logprob is None:
            scores.append(None)
            continue
        top = {str(i): item(lp, rank, tok) for rank, (i, tok, lp) in enumerate(entry.top, 1)}
        scores.append({str(entry.token_id): item(entry.logprob, entry.rank, entry.token)} | top)
    return scores


class ChatFormatter(_Formatter):
    """``chat.completion`` objects and ``chat.completion.chunk`` deltas. With
    ``tool_family`` each choice's text is read for tool calls in that family's format;
    with ``reasoning``, ``<think>...</think>`` becomes ``reasoning_content`` (with
    ``in_reasoning`` the text starts inside it: the prompt opened ``<think>``)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        response_id: str,
        model: str,
        include_usage: bool,
        num_choices: int,
        tool_family: str | None = None,
        reasoning: bool = False,
        in_reasoning: bool = False,
        prompt_logprobs: bool = False,
    ):
        super().__init__(response_id, model, include_usage)
        self._prompt_logprobs = prompt_logprobs
        self._announced = [False] * num_choices
        self._readers = [
            ChoiceReader(tool_family, reasoning, in_reasoning) for _ in range(num_choices)
        ]

    def stream_chunk(self, index: int, output: GenerationOutput) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if not self._announced[index]:  # the first delta of a choice names the role
            self._announced[index] = True
            delta["role"] = "assistant"
            delta["content"] = ""
        delta |= self._readers[index].read(output.text, final=output.finished).delta()
        if not (delta or output.finished or output.logprobs):
            return None
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": _chat_logprobs(output.logprobs),
            "finish_reason": self._finish_reason(index, output.finish_reason)
            if output.finished
            else None,
        }
        return self._chunk([choice])

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for an answer that ended after calling tools."""
        return "tool_calls" if reason == "stop" and self._readers[index].num_calls else reason

    def response(
        self,
        texts: Sequence[str],
        logprobs: Sequence[list[TokenLogprob] | None],
        progress: Sequence[ChoiceProgress],
        usage: dict[str, int],
    ) -> dict[str, Any]:
        choices = [
            {
                "index": index,
                "message": whole_message(self._readers[index], texts[index]),
                "logprobs": _chat_logprobs(logprobs[index]),
                "finish_reason": self._finish_reason(index, progress[index].finish_reason),
            }
            for index in range(len(texts))
        ]
        response = {**self._envelope(self.object_name, choices), "usage": usage}
        scores = progress[0].prompt_logprobs if progress else None
        if self._prompt_logprobs and scores is not None:  # vLLM's: one prompt, top level
            response["prompt_logprobs"] = _vllm_prompt_logprobs(scores)
        return response


def _chat_logprobs(entries: list[TokenLogprob] | None) -> dict | None:
    if entries is None:
        return None

    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode())}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(tok, lp) for _, tok, lp in e.top]}
            for e in entries
        ]
    }
