"""A thinking model's reasoning kept apart from its answer, as the text streams in.

Qwen3 and DeepSeek-R1-style models open their answer with ``<think>...</think>``; what
is inside is ``reasoning_content``, what follows is ``content`` (OpenAI-compatible
servers, vLLM among them, use these names). The parser is on when the chat template
knows ``</think>``. Text that does not start with ``<think>`` is all content, unless
the prompt itself opened the reasoning: DeepSeek-R1's and QwQ's templates end the
generation prompt with ``<think>``, so the answer starts inside it, with no opening tag
(``opens_reasoning``).
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt leaves the model inside its reasoning."""
    return prompt.rstrip().endswith(OPEN)


class ReasoningParser:
    """Feed text in pieces of any size; get ``(kind, text)`` with kind ``reasoning`` or
    ``content``. A tag split across pieces is held back until it is whole. ``inside``:
    the prompt opened the reasoning, so the text starts in it (an opening tag the model
    writes anyway is dropped)."""

    def __init__(self, inside: bool = False) -> None:
        self._inside = inside
        self._state = "start"
        self._buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        out: list[tuple[str, str]] = []
        if self._state == "start":
            head = self._buffer.lstrip()
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return out  # maybe the opening tag, still arriving
            if head.startswith(OPEN):
                self._buffer = head[len(OPEN) :]
                self._state = "thinking"
            else:
                self._state = "thinking" if self._inside else "answer"
        if self._state == "thinking":
            end = self._buffer.find(CLOSE)
            if end < 0:
                keep = _partial_suffix(self._buffer, CLOSE)
                self._emit(out, "reasoning", self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            self._emit(out, "reasoning", self._buffer[:end])
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._state = "after"
        if self._state == "after":  # the blank lines between reasoning and answer
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return out
            self._state = "answer"
        self._emit(out, "content", self._buffer)
        self._buffer = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        thinking = self._state == "thinking" or (self._state == "start" and self._inside)
        kind = "reasoning" if thinking else "content"
        if self._state != "after":
            self._emit(out, kind, self._buffer)
        self._buffer = ""
        return out

    @staticmethod
    def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
