"""``llmctl chat``: a terminal chat with an in-process engine or a remote server.

Three layers, top to bottom:

- the terminal front ends, ``run_interactive`` and ``run_piped``: read lines, stream
  answers to stdout, turn Ctrl-C into "stop this answer";
- ``ChatSession``: the conversation, the sampling settings and the slash commands;
- a connection: ``LocalConnection`` drives an ``Engine`` (llmctl/backend.py),
  ``RemoteConnection`` any OpenAI-compatible server over HTTP with SSE streaming.

A model without a chat template runs in continuation mode: the line typed is a plain
prompt and the answer is its continuation; earlier turns are not sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape

from llmctl.backend import Engine, GenerationRequest
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


class ServerError(LlmctlError):
    """The remote server cannot be reached, refused the request or failed mid-answer."""


class NoChatTemplate(LlmctlError):
    """The server refused chat messages because its model has no chat template."""


@dataclass
class Delta:
    """What one step of a stream adds. ``completion_tokens`` is a running total, when known."""

    text: str = ""
    completion_tokens: int | None = None
    finish_reason: str | None = None


class Connection(Protocol):
    """Where answers come from: an in-process engine or a remote server."""

    model_name: str
    has_chat_template: bool

    def stream(
        self,
        sampling: SamplingParams,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream one answer; leaving the iteration early stops it on the other side."""
        ...

    async def stats(self) -> list[tuple[str, str]]: ...

    async def close(self) -> None: ...


# --- the in-process engine ---------------------------------------------------------------


class LocalConnection:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        # The Engine contract says local engines apply the chat template themselves; an
        # engine that does not say otherwise is taken to have one.
        self.has_chat_template = bool(getattr(engine, "has_chat_template", True))

    async def stream(
        self,
        sampling: SamplingParams,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[Delta]:
        request_id = f"chat-{uuid.uuid4().hex}"
        request = GenerationRequest(request_id, prompt=prompt, messages=messages, sampling=sampling)
        finished = False
        try:
            async for output in self.engine.generate(request):
                finished = output.finished
                yield Delta(output.text, output.completion_tokens, output.finish_reason)
        finally:
            if not finished:  # stopped by the user: free the engine's slot and KV blocks
                await self.engine.abort(request_id)

    async def stats(self) -> list[tuple[str, str]]:
        stats = self.engine.stats()
        return [
            ("requests running", str(stats.running)),
            ("requests waiting", str(stats.waiting)),
            ("KV blocks used", f"{stats.kv_blocks_used} of {stats.kv_blocks_total}"),
            ("KV block size", f"{stats.block_size} tokens"),
            ("session length", f"{self.engine.max_model_len} tokens"),
        ]

    async def close(self) -> None:
        await self.engine.shutdown()


# --- a remote OpenAI-compatible server ---------------------------------------------------


class RemoteConnection:
    """Talks to ``/v1/chat/completions`` (or ``/v1/completions``) with ``stream: true``."""

    # Unknown until the server refuses chat messages; see ChatSession.ask.
    has_chat_template = True

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None) -> None:
        import httpx

        self.base_url = _base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model_name = model or _only_model(self.base_url, headers)
        # No read timeout: an answer may wait in the server's queue before its first token.
        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(30.0, read=None)
        )

    async def stream(
        self,
        sampling: SamplingParams,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[Delta]:
        import httpx

        body: dict[str, Any] = {
            "model": self.model_name,
            "stream": True,
            "stream_options": {"include_usage": True},
            **_sampling_fields(sampling),
        }
        if messages is not None:
            path, body["messages"] = "/v1/chat/completions", messages
        else:
            path, body["prompt"] = "/v1/completions", prompt
        try:
            # Leaving this block closes the HTTP stream, which tells the server to stop.
            async with self.client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    message = _error_text(response)
                    if (
                        response.status_code == 400
                        and messages is not None
                        and "chat template" in message.lower()
                    ):
                        raise NoChatTemplate(message)
                    raise ServerError(_http_error(self.base_url, response.status_code, message))
                async for event in _sse_events(response):
                    yield _delta(event)
        except httpx.HTTPError as exc:
            raise ServerError(f"lost the connection to {self.base_url}: {exc}") from None

    async def stats(self) -> list[tuple[str, str]]:
        import httpx

        try:
            response = await self.client.get("/metrics")
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach {self.base_url}/metrics: {exc}") from None
        if response.status_code != 200:
            raise ServerError(
                _http_error(self.base_url, response.status_code, _error_text(response))
            )
        return summarize_metrics(response.text)

    async def close(self) -> None:
        await self.client.aclose()


def _base_url(url: str) -> str:
    """The server root: ``http://host:port`` from that, a trailing ``/`` or ``/v1``."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ServerError(f"--url {url!r} must start with http:// or https://")
    return base.removesuffix("/v1")


def _only_model(base_url: str, headers: dict[str, str]) -> str:
    """The model the server serves, when it serves exactly one (else ask for --model)."""
    import httpx

    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise ServerError(
            f"cannot reach {base_url}: {exc}. Is the server running (`llmctl serve`)?"
        ) from None
    if response.status_code != 200:
        raise ServerError(_http_error(base_url, response.status_code, _error_text(response)))
    names = [entry["id"] for entry in response.json().get("data", [])]
    if len(names) != 1:
        listed = ", ".join(names) if names else "none"
        raise ServerError(f"{base_url} serves {listed}: name the model with --model NAME")
    return names[0]


def _sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
    }
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    if sampling.top_k > 0:  # not in OpenAI's API: send it only when asked for
        fields["top_k"] = sampling.top_k
    return fields


async def _sse_events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ServerError(f"the server failed mid-answer: {_message_of(event)}")
        yield event


def _delta(event: dict[str, Any]) -> Delta:
    """A chat (``delta.content``) or completions (``text``) chunk, with usage if present."""
    delta = Delta()
    for choice in event.get("choices") or []:
        delta.text += choice.get("delta", {}).get("content") or choice.get("text") or ""
        delta.finish_reason = choice.get("finish_reason") or delta.finish_reason
    if usage := event.get("usage"):
        delta.completion_tokens = usage.get("completion_tokens")
    return delta


def _error_text(response: Any) -> str:
    try:
        return _message_of(response.json())
    except ValueError:
        return response.text.strip() or response.reason_phrase


def _message_of(body: Any) -> str:
    """The message of an OpenAI-style ``{"error": {"message": ...}}`` or FastAPI body."""
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)
    return str(body)


def _http_error(base_url: str, status: int, message: str) -> str:
    if status in (401, 403):
        return (
            f"{base_url} refused the API key (HTTP {status}): {message}. "
            "Pass the server's key with --api-key (or LLMCTL_API_KEY)"
        )
    return f"{base_url} answered HTTP {status}: {message}"


def summarize_metrics(text: str) -> list[tuple[str, str]]:
    """The samples of a Prometheus text page worth a glance: no buckets, no process_/python_."""
    rows = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base.startswith(("process_", "python_")) or base.endswith(("_bucket", "_created")):
            continue
        rows.append((name, value))
    return rows


# --- the conversation --------------------------------------------------------------------


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
        count = f"{self.tokens} tokens" if self.exact_count else f"≈{self.tokens} chunks"
        parts = [f"{count} in {self.seconds:.2f} s, {rate:.1f}/s"]
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
                answer = await self._answer(text, write)
            except NoChatTemplate as exc:
                self.chat_mode = False
                self.notes.print(
                    f"[yellow]The server refused chat messages ({escape(str(exc))}).[/] "
                    + escape(continuation_note(self.connection.model_name))
                )
                answer = await self._answer(text, write)
        except BaseException:
            self.turns.pop()
            raise
        if answer.text or answer.finish_reason is not None:
            self.turns.append({"role": "assistant", "content": answer.text})
        else:  # stopped before a word came: as if never asked
            self.turns.pop()
        return answer

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
            self.notes.print(escape(HELP))
        elif name == "/reset":
            self.turns.clear()
            self.notes.print("[dim]Conversation cleared.[/]")
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
        self.notes.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)

    def _system(self, text: str) -> None:
        if not text:
            shown = escape(self.system) if self.system else "(none)"
            self.notes.print(f"System prompt: {shown}")
            return
        self.system = text
        unused = "" if self.chat_mode else " (not sent in continuation mode)"
        self.notes.print(f"[dim]System prompt set{unused}.[/]")

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
        self.notes.print(f"[dim]{name} = {getattr(self.sampling, name)}[/]")

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
        self.notes.print(f"[dim]Saved {len(self.turns)} messages to {escape(str(path))}.[/]")

    async def _stats(self) -> None:
        try:
            rows = await self.connection.stats()
        except LlmctlError as exc:
            self.error(str(exc))
            return
        for label, value in rows:
            self.notes.print(f"{escape(label)}: {escape(value)}")


# --- the terminal ------------------------------------------------------------------------

PROMPT = ">>> "


def run_interactive(session: ChatSession, *, banner: list[str], history_file: Path) -> None:
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
            _answer_line(session, loop, line)
    finally:
        if readline is not None:
            _save_history(readline, history_file)
        loop.run_until_complete(session.connection.close())
        loop.close()


def _answer_line(session: ChatSession, loop: asyncio.AbstractEventLoop, line: str) -> None:
    """Stream one answer; Ctrl-C cancels it (the answer ends, the chat goes on)."""
    out = _Stdout()
    task = loop.create_task(session.ask(line, out.write))
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    try:
        answer = loop.run_until_complete(task)
    except asyncio.CancelledError:  # stopped before the request even started
        session.notes.print("[dim]stopped[/]")
        return
    except LlmctlError as exc:
        out.end_line()
        session.error(str(exc))
        return
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    out.end_line()
    session.notes.print(f"[dim]{escape(answer.summary())}[/]")


def run_piped(session: ChatSession, text: str) -> None:
    """Answer ``text`` once on stdout (the answer and a newline, nothing else)."""
    if not text.strip():
        raise LlmctlError("nothing to answer: standard input was empty")

    async def answer_and_close() -> None:
        try:
            await session.ask(text, _Stdout().write)
        finally:
            await session.connection.close()

    asyncio.run(answer_and_close())
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
