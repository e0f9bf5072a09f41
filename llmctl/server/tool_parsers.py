"""Tool calls read out of a model's text, per model family, as the text streams in.

One small interface (``ToolCallParser``: ``feed`` text, then ``finish``) returns events:
``Content`` (text for the answer's ``content``), ``CallStart`` (a call's index and
name) and ``CallArguments`` (the next fragment of its arguments' JSON). Streamed
responses turn each event into a delta; whole responses join the same events, so the
joined stream equals the whole answer by construction.

The families (``FAMILIES``), as their chat templates ask models to write calls:
- ``hermes`` (Qwen2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``llama3_json`` (Llama 3.1+): the answer is ``{"name": ..., "parameters": {...}}``,
  several joined by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A call is a JSON object whose first key is ``name`` and whose second is ``arguments``
(or ``parameters``). The parser scans it character by character, tracking strings and
brackets, so an argument fragment is sent as soon as it is written and the end of the
arguments is known without waiting for the end of the text. Text that turns out not to
be a call (a ``{`` that is not ``{"name"``, a call cut off before its arguments) goes to
the content: nothing the model wrote is lost, and no call is left in the content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

FAMILIES = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str


Event = Content | CallStart | CallArguments


@dataclass(frozen=True)
class Family:
    """How one model family marks its calls."""

    opener: str  # what starts the calls ("" : a call at the start of the answer)
    closer: str  # what ends each call (after its object), "" if nothing
    separator: str  # between calls inside one opener ("" : calls are not grouped)
    list_open: str  # a bracket the calls sit in after the opener ("" : none)


_FAMILIES = {
    "hermes": Family("<tool_call>", "</tool_call>", "", ""),
    "llama3_json": Family("", "", ";", ""),
    "mistral": Family("[TOOL_CALLS]", "", ",", "["),
}

# The head of a call object: {"name": "NAME", "arguments": (whitespace allowed between).
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_COMPACT_HEAD = ('{"name":"', ',"arguments":', ',"parameters":')


def family_for_template(template: str | None) -> str:
    """The family a chat template writes calls in (``hermes`` when it does not say)."""
    if template and "[TOOL_CALLS]" in template:
        return "mistral"
    if template and "<|python_tag|>" in template or (template and "ipython" in template):
        return "llama3_json"
    return "hermes"


class ToolCallParser:
    """Reads one choice's text, fed in pieces of any size (a character at a time too)."""

    def __init__(self, family: str) -> None:
        self.family = _FAMILIES[family]
        self.num_calls = 0
        self._buffer = ""  # text not yet turned into events
        self._state = "content"
        self._consumed = ""  # the opener (and bracket) of the call being read
        self._held_space = ""  # whitespace in the content, sent once more content follows
        self._seen_text = False  # any content or call yet (llama3_json: calls come first)
        # Scanning a call's arguments: bracket depth, inside a string, after a backslash.
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            step = getattr(self, f"_{self._state}")(events)
            if not step:
                return events

    def finish(self) -> list[Event]:
        """The end of the text: whatever is held back is content (a call cut short keeps
        the arguments it has)."""
        events: list[Event] = []
        if self._state in ("opened", "head"):  # a call that never got its arguments
            self._emit_content(events, self._consumed + self._buffer, drop_space=True)
        elif self._state == "content":
            self._emit_content(events, self._buffer, drop_space=True)
        self._buffer = ""
        return events

    # Each state handler consumes what it can; True when the state changed (run again).

    def _content(self, events: list[Event]) -> bool:
        family = self.family
        text = self._buffer
        start = self._call_start(text)
        if start is not None:
            self._emit_content(events, text[:start], drop_space=True)
            self._buffer = text[start + len(family.opener) :]
            self._consumed = family.opener
            self._state = "opened" if family.opener else "head"
            return True
        keep = self._partial_opener(text)
        self._emit_content(events, text[: len(text) - keep])
        self._buffer = text[len(text) - keep :]
        return False

    def _call_start(self, text: str) -> int | None:
        family = self.family
        if family.opener:
            index = text.find(family.opener)
            return None if index < 0 else index
        # No opener (llama3_json): a call is an answer that starts with "{".
        if not self._seen_text and not self.num_calls and text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip())
        return None

    def _partial_opener(self, text: str) -> int:
        """How many trailing characters could be the start of the opener (held back)."""
        opener = self.family.opener
        if not opener:
            # llama3_json: an answer of only whitespace so far may still open a call.
            return len(text) if not self._seen_text and not text.strip() else 0
        for size in range(min(len(opener) - 1, len(text)), 0, -1):
            if opener.startswith(text[-size:]):
                return size
        return 0

    def _emit_content(self, events: list[Event], text: str, drop_space: bool = False) -> None:
        """Content, with whitespace next to a call dropped (held until text follows)."""
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = "" if drop_space else text[len(stripped) :]
        if self.num_calls and not self._seen_text:
            stripped = stripped.lstrip()
        if stripped:
            self._seen_text = True
            events.append(Content(stripped))

    def _opened(self, events: list[Event]) -> bool:
        """After the opener: skip whitespace and the list bracket, then a call's head."""
        text = self._buffer.lstrip()
        bracket = self.family.list_open
        if not text:
            return False
        if bracket and text.startswith(bracket):
            cut = len(self._buffer) - len(text) + len(bracket)
            self._consumed += self._buffer[:cut]
            self._buffer = self._buffer[cut:]
        self._state = "head"
        return True

    def _head(self, events: list[Event]) -> bool:
        match = _HEAD.match(self._buffer)
        if match is None or match.end() == len(self._buffer):
            if match is None and not _could_be_head(self._buffer):
                # Not a call after all: what was read is content.
                self._state = "content"
                self._emit_content(events, self._consumed + self._buffer)
                self._buffer = ""
            return False
        try:
            name = json.loads(f'"{match.group(1)}"')
        except json.JSONDecodeError:
            name = match.group(1)
        events.append(CallStart(self.num_calls, name))
        self.num_calls += 1
        self._buffer = self._buffer[match.end() :]
        self._depth, self._in_string, self._escaped = 0, False, False
        self._state = "arguments"
        return True

    def _arguments(self, events: list[Event]) -> bool:
        """Send argument characters until the value they open is closed."""
        index = self.num_calls - 1
        text = self._buffer
        end = None
        for position, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    end = position + 1
                    break
            elif self._depth == 0 and char in ",}":  # a scalar argument ended
                end = position
                break
        fragment = text if end is None else text[:end]
        if fragment:
            events.append(CallArguments(index, fragment))
        self._buffer = "" if end is None else text[end:]
        if end is None:
            return False
        self._state = "closing"
        return True

    def _closing(self, events: list[Event]) -> bool:
        """After the arguments: the call object's "}", then the family's closer or
        separator; anything else goes back to content."""
        text = self._buffer.lstrip()
        if not text:
            self._buffer = ""
            return False
        self._buffer = text[1:] if text.startswith("}") else text
        self._state = "between" if text.startswith("}") else "content"
        return True

    def _between(self, events: list[Event]) -> bool:
        family = self.family
        text = self._buffer.lstrip()
        if not text:
            self._buffer = ""
            return False
        for marker in (family.closer, family.separator):
            if marker and len(text) < len(marker) and marker.startswith(text):
                self._buffer = text
                return False  # maybe the marker, still arriving
        if family.closer and text.startswith(family.closer):
            self._buffer = text[len(family.closer) :]
            self._state = "content"
            return True
        if family.separator and text.startswith(family.separator):
            self._buffer = text[len(family.separator) :]
            self._consumed = ""
            self._state = "head" if family.opener else "content_call"
            return True
        if family.list_open and text.startswith("]"):
            self._buffer = text[1:]
            self._state = "content"
            return True
        self._buffer = text
        self._state = "content"
        return True

    def _content_call(self, events: list[Event]) -> bool:
        """llama3_json after ";": the next call, once its "{" arrives."""
        text = self._buffer.lstrip()
        if not text:
            self._buffer = ""
            return False
        self._buffer = text
        self._state = "head" if text.startswith("{") else "content"
        return True


def _could_be_head(text: str) -> bool:
    """Whether more text could still make ``text`` a call's head (whitespace outside
    strings does not matter)."""
    compact = _compact(text)
    head, *keys = _COMPACT_HEAD
    if len(compact) <= len(head):
        return head.startswith(compact)
    if not compact.startswith(head):
        return False
    rest = compact[len(head) :]
    end = _string_end(rest)
    if end is None:
        return True  # still inside the name
    after = rest[end + 1 :]
    return any(key.startswith(after) or after.startswith(key) for key in keys)


def _compact(text: str) -> str:
    out, in_string, escaped = [], False, False
    for char in text:
        if in_string:
            out.append(char)
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
            out.append(char)
        elif not char.isspace():
            out.append(char)
    return "".join(out)


def _string_end(text: str) -> int | None:
    escaped = False
    for position, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return position
    return None
