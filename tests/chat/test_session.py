"""``ChatSession`` over a real in-process engine, and the parsing helpers of llmctl.chat."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from llmctl import LLM, SamplingParams
from llmctl.chat.connection import LocalConnection
from llmctl.chat.remote import ServerError, check_url, chunk_delta, summarize_metrics
from llmctl.chat.session import Answer, ChatSession, set_sampling
from llmctl.errors import InvalidRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def new_session(llm: LLM, system: str | None = None) -> tuple[ChatSession, io.StringIO]:
    notes = io.StringIO()
    console = Console(file=notes, width=200, no_color=True, highlight=False)
    return ChatSession(LocalConnection(llm.engine), GREEDY, system=system, notes=console), notes


def ask(session: ChatSession, text: str) -> tuple[Answer, str]:
    streamed: list[str] = []
    answer = asyncio.run(session.ask(text, streamed.append))
    return answer, "".join(streamed)


def test_chat_mode_sends_the_whole_conversation(qa_llm: LLM) -> None:
    session, _ = new_session(qa_llm, system="A story about a dog.")
    assert session.chat_mode  # the engine has a chat template: multi-turn
    history: list[dict[str, str]] = [{"role": "system", "content": "A story about a dog."}]
    for question in ["Once upon a time", "What did Lily see?"]:
        history.append({"role": "user", "content": question})
        expected = qa_llm.chat(history, GREEDY)[0]
        answer, streamed = ask(session, question)
        assert streamed == answer.text == expected.text
        assert answer.tokens == len(expected.token_ids)
        assert answer.finish_reason == expected.finish_reason
        history.append({"role": "assistant", "content": expected.text})
    assert session.messages() == history


def test_refused_request_leaves_no_trace(qa_llm: LLM) -> None:
    session, _ = new_session(qa_llm)
    session.sampling = SamplingParams(temperature=0, max_tokens=qa_llm.engine.max_model_len)
    with pytest.raises(InvalidRequest, match="more than session_len"):
        ask(session, "Once upon a time")
    assert session.turns == []


def test_commands(qa_llm: LLM, tmp_path: Path) -> None:
    session, notes = new_session(qa_llm)
    run = asyncio.run

    assert run(session.command("/system You are a storyteller."))
    assert session.system == "You are a storyteller."
    run(session.command("/system"))
    assert "System prompt: You are a storyteller." in notes.getvalue()

    run(session.command("/set seed 7"))
    run(session.command("/set top_k 5"))
    assert (session.sampling.seed, session.sampling.top_k) == (7, 5)
    run(session.command("/set seed none"))
    assert session.sampling.seed is None
    run(session.command("/set max_tokens"))
    assert "usage: /set NAME VALUE" in notes.getvalue()

    ask(session, "Once upon a time")
    saved = tmp_path / "chat.json"
    run(session.command(f"/save {saved}"))
    transcript = json.loads(saved.read_text())
    assert transcript["mode"] == "chat"
    assert [m["role"] for m in transcript["messages"]] == ["system", "user", "assistant"]
    assert transcript["sampling"] == {
        "temperature": 0,
        "top_p": 1.0,
        "top_k": 5,
        "max_tokens": 12,
        "seed": None,
    }
    run(session.command(f"/save {tmp_path / 'missing' / 'chat.json'}"))
    assert "error: cannot write" in notes.getvalue()

    run(session.command("/reset"))
    assert session.turns == [] and session.system == "You are a storyteller."
    run(session.command("/stats"))
    assert "requests running: 0" in notes.getvalue()
    assert not run(session.command("/exit"))


@pytest.mark.parametrize(
    ("name", "raw", "error"),
    [
        ("temperature", "warm", "temperature must be a number, got 'warm'"),
        ("top_k", "1.5", "top_k must be an integer, got '1.5'"),
        ("top_p", "0", "top_p must be in (0, 1], got 0.0"),
        ("max_tokens", "0", "max_tokens must be at least 1, got 0"),
        ("seed", "lucky", "seed must be an integer, got 'lucky'"),
        ("min_p", "0.1", "cannot set 'min_p': choose one of temperature, top_p"),
    ],
)
def test_set_refuses_bad_values(name: str, raw: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        set_sampling(SamplingParams(), name, raw)


def test_sse_chunks_of_both_endpoints() -> None:
    chat = {"choices": [{"index": 0, "delta": {"content": " big"}, "finish_reason": None}]}
    assert chunk_delta(chat).text == " big"
    completion = {"choices": [{"index": 0, "text": " dog", "finish_reason": "length"}]}
    assert (chunk_delta(completion).text, chunk_delta(completion).finish_reason) == (
        " dog",
        "length",
    )
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}
    assert (chunk_delta(usage).text, chunk_delta(usage).completion_tokens) == ("", 9)


def test_server_urls() -> None:
    assert check_url("http://host:8000/v1/") == "http://host:8000"
    assert check_url(" https://host ") == "https://host"
    with pytest.raises(ServerError, match="must start with http:// or https://"):
        check_url("host:8000")


def test_metrics_summary_skips_noise() -> None:
    page = "\n".join(
        [
            "# HELP llmctl_num_requests_running Requests running",
            "# TYPE llmctl_num_requests_running gauge",
            "llmctl_num_requests_running 2.0",
            'llmctl_ttft_seconds_bucket{le="0.1"} 3.0',
            "llmctl_ttft_seconds_sum 0.25",
            "process_cpu_seconds_total 1.5",
            "python_gc_objects_collected_total 10.0",
        ]
    )
    assert summarize_metrics(page) == [
        ("llmctl_num_requests_running", "2.0"),
        ("llmctl_ttft_seconds_sum", "0.25"),
    ]


def test_answer_summary() -> None:
    stopped = Answer("text", 10, True, 2.0, 0.5, None)
    assert stopped.summary() == "10 tokens in 2.00 s, 5.0 tokens/s · first after 0.50 s · stopped"
    chunks = Answer("text", 4, False, 1.0, None, "length")
    assert chunks.summary().startswith("4 chunks in 1.00 s, 4.0 chunks/s · max_tokens reached")
