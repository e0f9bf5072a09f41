"""A chat choice's text as reasoning, content and tool calls: streamed deltas, fed one
character at a time, join to exactly the whole answer."""

from __future__ import annotations

import json

import pytest

from llmctl.server.chat_output import ChoiceReader, whole_message
from llmctl.server.reasoning import ReasoningParser, opens_reasoning

TEXT = (
    "<think>\nThe user wants weather; call the tool.\n</think>\n\n"
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def joined_stream(reader: ChoiceReader, text: str, step: int) -> dict:
    """What a client gets by joining the deltas of ``text`` streamed ``step`` chars a time."""
    message = {"reasoning_content": "", "content": "", "tool_calls": {}}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for number, piece in enumerate(pieces):
        delta = reader.read(piece, final=number == len(pieces) - 1).delta()
        message["reasoning_content"] += delta.get("reasoning_content", "")
        message["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            joined = message["tool_calls"].setdefault(call["index"], {"arguments": ""})
            if "id" in call:
                joined["id"], joined["name"] = call["id"], call["function"]["name"]
            joined["arguments"] += call["function"]["arguments"]
    return message


@pytest.mark.parametrize("step", [1, 2, 7, len(TEXT)])
def test_streamed_deltas_join_to_the_whole_message(step) -> None:
    streamed = joined_stream(ChoiceReader("hermes", reasoning=True), TEXT, step)
    whole = whole_message(ChoiceReader("hermes", reasoning=True), TEXT)
    assert streamed["reasoning_content"] == whole["reasoning_content"]
    assert whole["reasoning_content"] == "\nThe user wants weather; call the tool.\n"
    assert streamed["content"] == whole["content"] == "Checking."
    calls = [streamed["tool_calls"][i] for i in sorted(streamed["tool_calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        (c["name"], c["arguments"]) for c in calls
    ]


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>a < b</think>answer", "a < b", "answer"),
        ("no thinking here", "", "no thinking here"),
        ("<thi", "", "<thi"),
        ("<think>cut off mid-thought </thi", "cut off mid-thought </thi", ""),
        ("  <think></think>\n\nx", "", "x"),
    ],
)
def test_reasoning_is_split_the_same_char_by_char(text, reasoning, content) -> None:
    for step in (1, len(text)):
        parser = ReasoningParser()
        parts = []
        for i in range(0, len(text), step):
            parts += parser.feed(text[i : i + step])
        parts += parser.finish()
        assert "".join(t for k, t in parts if k == "reasoning") == reasoning
        assert "".join(t for k, t in parts if k == "content") == content


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("a < b</think>\n\nanswer", "a < b", "answer"),
        ("<think>tag written anyway</think>x", "tag written anyway", "x"),
        ("never closed <", "never closed <", ""),
        ("<th", "<th", ""),
        ("</think>only the answer", "", "only the answer"),
    ],
)
def test_reasoning_opened_by_the_prompt_is_split_char_by_char(text, reasoning, content) -> None:
    """DeepSeek-R1-style templates end the prompt with ``<think>``: no opening tag comes."""
    for step in (1, len(text)):
        parser = ReasoningParser(inside=True)
        parts = []
        for i in range(0, len(text), step):
            parts += parser.feed(text[i : i + step])
        parts += parser.finish()
        assert "".join(t for k, t in parts if k == "reasoning") == reasoning
        assert "".join(t for k, t in parts if k == "content") == content


def test_prompts_that_open_reasoning() -> None:
    assert opens_reasoning("<｜User｜>Hi<｜Assistant｜><think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not opens_reasoning("<|im_start|>assistant\n")
