"""Remote chat never gets stuck: a server's model without a chat template puts it in
plain continuation mode (with a notice) from the first turn, and a conversation that no
longer fits the session drops its oldest turns, says so, and keeps the newest that fit.
Real servers on stories260K, real HTTP, the real ChatSession."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from llmctl import SamplingParams
from llmctl.chat.remote import RemoteConnection
from llmctl.chat.session import ChatSession
from tests.chat.conftest import QA_TEMPLATE
from tests.helpers.server_process import running_server

GREEDY = SamplingParams(temperature=0, max_tokens=24)
LINES = [
    "Once upon a time, there was a little girl named Lily.",
    "She liked to play in the park with her dog.",
    "One day, the sun was hot and the sky was blue.",
    "Lily saw a big red ball under a tree.",
    "She ran to get it, and her dog ran too.",
    "Then a bird flew down and sat on the ball.",
]


def session_on(url: str) -> tuple[ChatSession, io.StringIO]:
    notes = io.StringIO()
    console = Console(file=notes, width=300, no_color=True)
    return ChatSession(RemoteConnection(url), GREEDY, notes=console), notes


def talk(session: ChatSession, lines: list[str]) -> list[str]:
    async def run() -> list[str]:
        answers = []
        try:
            for line in lines:
                answers.append((await session.ask(line, lambda piece: None)).text)
        finally:
            await session.connection.close()
        return answers

    return asyncio.run(run())


@pytest.mark.slow  # starts a server of its own
def test_no_chat_template_is_continuation_mode_from_the_first_turn(stories: Path) -> None:
    with running_server([str(stories), "--backend", "torch", "--session-len", "64"]) as url:
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert models[0]["chat_template"] is False
        session, _ = session_on(url)
        assert not session.chat_mode
        answers = talk(session, LINES)  # each turn alone fits 64 tokens; the history would not
        expected = [
            httpx.post(
                f"{url}/v1/completions",
                json={"prompt": line, "max_tokens": 24, "temperature": 0},
            ).json()["choices"][0]["text"]
            for line in LINES
        ]
    assert answers == expected


@pytest.mark.slow  # starts a server of its own
def test_a_history_that_no_longer_fits_keeps_the_newest_turns(stories: Path) -> None:
    args = [str(stories), "--backend", "torch", "--session-len", "128"]
    with running_server([*args, "--chat-template", QA_TEMPLATE]) as url:
        session, notes = session_on(url)
        assert session.chat_mode
        answers = talk(session, LINES)
        assert len(answers) == len(LINES) and all(answers)
        # The history was cut: the oldest turns are gone, the newest kept, in order.
        users = [m["content"] for m in session.turns if m["role"] == "user"]
        assert users == LINES[-len(users) :] and len(users) < len(LINES)
        assert "no longer fits the model's session" in notes.getvalue()
        # What is kept fits: the server takes it with the answer's max_tokens.
        fits = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": session.turns, "max_tokens": 24, "temperature": 0},
        )
        assert fits.status_code == 200, fits.text


def test_a_message_too_long_on_its_own_is_refused_and_leaves_no_trace(stories: Path) -> None:
    from llmctl import LLM
    from llmctl.chat.connection import LocalConnection
    from llmctl.errors import InvalidRequest

    with LLM(str(stories), backend="torch", session_len=64, chat_template=QA_TEMPLATE) as llm:
        notes = io.StringIO()
        session = ChatSession(
            LocalConnection(llm.engine), GREEDY, notes=Console(file=notes, no_color=True)
        )
        assert asyncio.run(session.ask(LINES[0], lambda piece: None)).text
        with pytest.raises(InvalidRequest):
            asyncio.run(session.ask(" ".join(LINES * 3), lambda piece: None))
        assert [m["content"] for m in session.turns if m["role"] == "user"] == [LINES[0]]


def test_an_answer_stopped_with_ctrl_c_counts_tokens(stories_server: str) -> None:
    """The server's usage rides on every chunk (continuous_usage_stats), so an answer
    cut short still reports tokens, not chunks."""
    from tests.chat.conftest import API_KEY

    session = ChatSession(
        RemoteConnection(stories_server, api_key=API_KEY),
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        notes=Console(file=io.StringIO()),
    )
    pieces: list[str] = []

    def write_then_stop(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 5:  # Ctrl-C: the terminal cancels the task that streams
            asyncio.current_task().cancel()

    async def run():
        try:
            return await session.ask("Once upon a time", write_then_stop)
        finally:
            await session.connection.close()

    answer = asyncio.run(run())
    assert answer.finish_reason is None  # stopped
    assert answer.exact_count and 5 <= answer.tokens < 64
    assert answer.summary().startswith(f"{answer.tokens} tokens in ")
    assert "chunks" not in answer.summary()
