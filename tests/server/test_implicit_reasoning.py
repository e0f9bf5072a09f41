"""A template whose generation prompt opens ``<think>`` (DeepSeek-R1, QwQ): the answer
starts inside the reasoning with no opening tag, and ``reasoning_content`` still comes
apart from ``content``, streamed and whole, through a real ``llmctl serve demo``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.server_process import start_server
from tests.server.conftest import QUIET_THREADS

R1_TEMPLATE = Path(__file__).parents[1] / "data" / "deepseek_r1_template.jinja"
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    process = start_server(
        ["demo", "--backend", "torch", "--chat-template", str(R1_TEMPLATE)], env=QUIET_THREADS
    )
    try:
        yield process.url
    finally:
        process.stop()


def joined(chunks) -> dict[str, str]:
    parts = {"reasoning_content": "", "content": ""}
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            parts["reasoning_content"] += extra.get("reasoning_content") or ""
            parts["content"] += choice.delta.content or ""
    return parts


def test_reasoning_opened_by_the_prompt_is_split_from_the_answer(url) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    # The grammar makes the random demo model close its reasoning, then answer.
    ask = dict(
        model="demo",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{4,8}</think>\n\n[A-Z]{3}"}},
    )
    whole = client.chat.completions.create(**ask).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{4,8}", reasoning), whole
    assert re.fullmatch("[A-Z]{3}", whole.content), whole
    streamed = joined(client.chat.completions.create(**ask, stream=True))
    assert streamed == {"reasoning_content": reasoning, "content": whole.content}


def test_an_answer_that_never_closes_is_all_reasoning(url) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompt = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = (
        client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    assert "</think>" not in text
    ask = dict(model="demo", messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0].message
    assert whole.model_extra["reasoning_content"] == text and whole.content == ""
    streamed = joined(client.chat.completions.create(**ask, stream=True))
    assert streamed == {"reasoning_content": text, "content": ""}
