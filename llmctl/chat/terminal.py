"""The terminal front ends: an interactive loop with line editing, and piped one-shot use."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from rich.text import Text

from llmctl.chat.session import Answer, ChatSession
from llmctl.errors import LlmctlError

PROMPT = ">>> "


def run_interactive(session: ChatSession, *, banner: list[Text], history_file: Path) -> None:
    """Read a line, answer it, repeat, until Ctrl-D or /exit."""
    loop = asyncio.new_event_loop()
    readline = _line_editing(history_file)
    try:
        for line in banner:
            session.notes.print(line, soft_wrap=True)
        while True:
            try:
                line = input(PROMPT).strip()
            except EOFError:  # Ctrl-D
                print()
                break
            except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, stay
                print("^C (Ctrl-D or /exit leaves)")
                continue
            if not line:
                continue
            if line.startswith("/"):
                if not loop.run_until_complete(session.command(line)):
                    break
                continue
            try:
                _answer_line(session, loop, line)
            except KeyboardInterrupt:  # Ctrl-C in the instant before the answer started
                print("^C")
    finally:
        if readline is not None:
            _save_history(readline, history_file)
        loop.run_until_complete(session.connection.close())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _answer_line(session: ChatSession, loop: asyncio.AbstractEventLoop, line: str) -> None:
    """Stream one answer; Ctrl-C cancels it (the answer ends, the chat goes on)."""
    out = _Stdout()
    loop.add_signal_handler(signal.SIGINT, _cancel_all_tasks, loop)
    try:
        answer = loop.run_until_complete(session.ask(line, out.write))
    except asyncio.CancelledError:  # stopped before the request even started
        session.notes.print(Text("stopped", style="dim"))
        return
    except LlmctlError as exc:
        out.end_line()
        session.error(str(exc))
        return
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    out.end_line()
    session.notes.print(Text(answer.summary(), style="dim"))


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Ctrl-C during an answer: cancel it (the only task), whenever it started."""
    for task in asyncio.all_tasks(loop):
        task.cancel()


def run_piped(session: ChatSession, text: str) -> None:
    """Answer ``text`` once on stdout (the answer and a newline, nothing else)."""

    async def answer_and_close() -> Answer:
        try:
            return await session.ask(text, _Stdout().write)
        finally:
            await session.connection.close()

    answer = asyncio.run(answer_and_close())
    if answer.finish_reason is None:  # Ctrl-C stopped it: a script must not take it as whole
        raise KeyboardInterrupt
    sys.stdout.write("\n")
    sys.stdout.flush()


class _Stdout:
    """Writes answer text as it streams, remembering whether its last line is open."""

    def __init__(self) -> None:
        self.line_open = False

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        if self.line_open:
            sys.stdout.write("\n")
            self.line_open = False


def _line_editing(history_file: Path) -> Any:
    """Turn on readline editing and history for ``input()``; None where readline is absent."""
    try:
        import readline
    except ImportError:  # e.g. Windows: input() still works, without history
        return None
    try:
        readline.read_history_file(history_file)
    except OSError:  # first run, or an unreadable file: start with no history
        pass
    readline.set_history_length(1000)
    return readline


def _save_history(readline: Any, history_file: Path) -> None:
    try:
        history_file.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(history_file)
    except OSError:  # history is a convenience: never fail the chat over it
        pass
