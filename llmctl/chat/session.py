"""One conversation: its turns, system prompt, sampling settings and slash commands."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from llmctl.chat.connection import Connection, NoChatTemplate
from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import LlmctlError

INTERACTIVE_TEMPERATURE = 0.7
PIPED_TEMPERATURE = 0.0  # greedy: a script gets the same answer every time
DEFAULT_MAX_TOKENS = 256

HELP = """\
/help               this list
/reset              forget the conversation (the system prompt stays)
/system [TEXT]      show or set the system prompt
/set NAME VALUE     set temperature, top_p, top_k, max_tokens or seed (`none` unsets it)
/save FILE          write the transcript as JSON
/stats              engine statistics (local) or a summary of the server's /metrics
/exit               leave (Ctrl-D does too); Ctrl-C stops the answer being written"""


@dataclass
class Answer:
    """How one answer went, for the dim line printed after it."""

    text: str
    tokens: int
    exact_count: bool  # False: the server sent no usage, ``tokens`` counts chunks
    seconds: float
    first_token_seconds: float | None
    finish_reason: str | None  # None: stopped with Ctrl-C

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        unit = "tokens" if self.exact_count else "chunks"  # a chunk is about a token
        parts = [f"{self.tokens} {unit} in {self.seconds:.2f} s, {rate:.1f} {unit}/s"]
        if self.first_token_seconds is not None:
            parts.append(f"first after {self.first_token_seconds:.2f} s")
        if self.finish_reason is None:
            parts.append("stopped")
        elif self.finish_reason == "length":
            parts.append("max_tokens reached (/set max_tokens N for longer answers)")
        return " · ".join(parts)


# Sampling settings `/set` changes, with how to read each value.
SETTABLE: dict[str, Callable[[str], Any]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": int,
    "seed": lambda raw: None if raw.lower() == "none" else int(raw),
}


def set_sampling(sampling: SamplingParams, name: str, raw: str) -> SamplingParams:
    """``sampling`` with ``name`` set from ``raw``; ValueError says what is wrong."""
    if name not in SETTABLE:
        raise ValueError(f"cannot set {name!r}: choose one of {', '.join(SETTABLE)}")
    try:
        value = SETTABLE[name](raw)
    except ValueError:
        kind = "a number" if SETTABLE[name] is float else "an integer"
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None
    return dataclasses.replace(sampling, **{name: value})  # __post_init__ checks the range


def continuation_note(model_name: str) -> str:
    return (
        f"{model_name} has no chat template: plain continuation mode. The line you type is "
        "continued as text; earlier turns and the system prompt are not sent."
    )


class ChatSession:
    """The conversation with one model: turns, system prompt, sampling and commands."""

    def __init__(
        self,
        connection: Connection,
        sampling: SamplingParams,
        *,
        system: str | None = None,
        notes: Console,
    ) -> None:
        self.connection = connection
        self.sampling = sampling
        self.system = system
        self.turns: list[dict[str, str]] = []  # user and assistant messages, in order
        self.chat_mode = connection.has_chat_template
        self.notes = notes  # where messages that are not the answer go

    def messages(self) -> list[dict[str, str]]:
        """The conversation as OpenAI-style messages, system prompt first."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    async def ask(self, text: str, write: Callable[[str], None]) -> Answer:
        """Send ``text`` as the next user turn and stream the answer through ``write``.

        A stopped answer keeps what was shown; a refused request leaves no trace.
        """
        self.turns.append({"role": "user", "content": text})
        try:
            try:
                answer = await self._answer_fitting(text, write)
            except NoChatTemplate as exc:
                self.chat_mode = False
                self.notes.print(
                    Text.assemble(
                        (f"The server refused chat messages ({exc}).", "yellow"),
                        " " + continuation_note(self.connection.model_name),
                    )
                )
                answer = await self._answer_fitting(text, write)
        except BaseException:
            self.turns.pop()
            raise
        if answer.text or answer.finish_reason is not None:
            self.turns.append({"role": "assistant", "content": answer.text})
        else:  # stopped before a word came: as if never asked
            self.turns.pop()
        return answer

    async def _answer_fitting(self, text: str, write: Callable[[str], None]) -> Answer:
        """``_answer``; when the conversation no longer fits the model's session, drop the
        oldest messages until it does (and say so before the answer), so a long chat
        never gets stuck. A message too long on its own is refused, the history intact."""
        dropped = 0
        before = list(self.turns)  # restored if even the new message alone is too long

        def note_then_write(piece: str) -> None:
            nonlocal dropped
            if dropped:
                self.notes.print(
                    Text(
                        f"The conversation no longer fits the model's session: the oldest "
                        f"{dropped} message(s) were left out; the newest turns that fit are "
                        "kept (/reset starts afresh).",
                        style="yellow",
                    )
                )
                dropped = 0
            write(piece)

        while True:
            try:
                return await self._answer(text, note_then_write)
            except LlmctlError as exc:
                too_long = getattr(exc, "code", None) == "context_length_exceeded"
                if not (too_long and self.chat_mode and len(self.turns) > 1):
                    self.turns[:] = before
                    raise
                oldest = min(2, len(self.turns) - 1)  # a user turn and its answer
                del self.turns[:oldest]
                dropped += oldest

    async def _answer(self, text: str, write: Callable[[str], None]) -> Answer:
        if self.chat_mode:
            stream = self.connection.stream(self.sampling, messages=self.messages())
        else:
            stream = self.connection.stream(self.sampling, prompt=text)
        started = time.perf_counter()
        pieces: list[str] = []
        chunks, reported, first, finish_reason = 0, None, None, None
        try:
            async with aclosing(stream):
                async for delta in stream:
                    if delta.text:
                        first = first if first is not None else time.perf_counter() - started
                        chunks += 1
                        pieces.append(delta.text)
                        write(delta.text)
                    reported = delta.completion_tokens or reported
                    finish_reason = delta.finish_reason or finish_reason
        except asyncio.CancelledError:  # Ctrl-C: the stream is closed, the request aborted
            finish_reason = None
        return Answer(
            text="".join(pieces),
            tokens=reported if reported is not None else chunks,
            exact_count=reported is not None or chunks == 0,
            seconds=time.perf_counter() - started,
            first_token_seconds=first,
            finish_reason=finish_reason,
        )

    async def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.notes.print(Text(HELP))
        elif name == "/reset":
            self.turns.clear()
            self.notes.print(Text("Conversation cleared.", style="dim"))
        elif name == "/system":
            self._system(arg)
        elif name == "/set":
            self._set(arg)
        elif name == "/save":
            self._save(arg)
        elif name == "/stats":
            await self._stats()
        else:
            self.error(f"unknown command {name}: /help lists the commands")
        return True

    def error(self, message: str) -> None:
        self.notes.print(Text.assemble(("error:", "red"), " " + message), soft_wrap=True)

    def _system(self, text: str) -> None:
        if not text:
            self.notes.print(Text(f"System prompt: {self.system or '(none)'}"))
            return
        self.system = text
        unused = "" if self.chat_mode else " (not sent in continuation mode)"
        self.notes.print(Text(f"System prompt set{unused}.", style="dim"))

    def _set(self, arg: str) -> None:
        name, _, raw = arg.partition(" ")
        if not name or not raw.strip():
            self.error(f"usage: /set NAME VALUE with NAME one of {', '.join(SETTABLE)}")
            return
        try:
            self.sampling = set_sampling(self.sampling, name, raw.strip())
        except ValueError as exc:
            self.error(str(exc))
            return
        self.notes.print(Text(f"{name} = {getattr(self.sampling, name)}", style="dim"))

    def transcript(self) -> dict[str, Any]:
        return {
            "model": self.connection.model_name,
            "mode": "chat" if self.chat_mode else "continuation",
            "sampling": {name: getattr(self.sampling, name) for name in SETTABLE},
            "messages": self.messages(),
        }

    def _save(self, arg: str) -> None:
        if not arg:
            self.error("usage: /save FILE")
            return
        path = Path(arg).expanduser()
        try:
            path.write_text(json.dumps(self.transcript(), indent=2, ensure_ascii=False) + "\n")
        except OSError as exc:
            self.error(f"cannot write {path}: {exc.strerror or exc}")
            return
        self.notes.print(Text(f"Saved {len(self.turns)} messages to {path}.", style="dim"))

    async def _stats(self) -> None:
        try:
            rows = await self.connection.stats()
        except LlmctlError as exc:
            self.error(str(exc))
            return
        for label, value in rows:
            self.notes.print(Text(f"{label}: {value}"))
