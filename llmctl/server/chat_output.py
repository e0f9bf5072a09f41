"""One chat choice's text as OpenAI's message parts: ``reasoning_content``, ``content``
and ``tool_calls``, built the same way for streamed deltas and whole answers.

The text goes through the reasoning parser (when the model thinks), then what is
content through the tool-call parser (when the request has tools). A whole answer is
the join of the parts its stream would have sent.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from llmctl.server.reasoning import ReasoningParser
from llmctl.server.tool_parsers import CallArguments, CallStart, Content, ToolCallParser


@dataclass
class Parts:
    """What one piece of text adds to a choice."""

    reasoning: str = ""
    content: str = ""
    # By call index: [id, name, arguments fragment]; id and name only on a call's first.
    calls: dict[int, list[Any]] = field(default_factory=dict)

    def delta(self) -> dict[str, Any]:
        """The parts as a streamed ``delta`` (only what is there)."""
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = [
                _call_delta(index, *call) for index, call in sorted(self.calls.items())
            ]
        return delta


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict:
    if call_id is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ChoiceReader:
    """Reads one choice's text; ``tool_family`` None: no tools, ``reasoning`` False: no
    thinking model; ``in_reasoning``: the prompt opened the reasoning (``<think>``)."""

    def __init__(self, tool_family: str | None, reasoning: bool, in_reasoning: bool = False):
        self._reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self._tools = ToolCallParser(tool_family) if tool_family else None
        self._call_ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self._call_ids)

    def read(self, text: str, final: bool = False) -> Parts:
        parts = Parts()
        if self._reasoning is None:
            pieces = [("content", text)]
        else:
            pieces = self._reasoning.feed(text)
            if final:
                pieces += self._reasoning.finish()
        for kind, piece in pieces:
            if kind == "reasoning":
                parts.reasoning += piece
            elif self._tools is None:
                parts.content += piece
            else:
                self._add_events(parts, self._tools.feed(piece))
        if final and self._tools is not None:
            self._add_events(parts, self._tools.finish())
        return parts

    def _add_events(self, parts: Parts, events: list) -> None:
        for event in events:
            if isinstance(event, Content):
                parts.content += event.text
            elif isinstance(event, CallStart):
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                self._call_ids.append(call_id)
                parts.calls[event.index] = [call_id, event.name, ""]
            elif isinstance(event, CallArguments):
                parts.calls.setdefault(event.index, [None, None, ""])[2] += event.fragment


def whole_message(reader: ChoiceReader, text: str) -> dict[str, Any]:
    """The whole answer's ``message``: the same parts a stream of ``text`` would send."""
    parts = reader.read(text, final=True)
    message: dict[str, Any] = {"role": "assistant", "content": parts.content}
    if parts.reasoning:
        message["reasoning_content"] = parts.reasoning
    if parts.calls:
        message["content"] = parts.content or None  # as OpenAI: null beside tool calls
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for _, (call_id, name, arguments) in sorted(parts.calls.items())
        ]
    return message
