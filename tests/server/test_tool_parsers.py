"""Tool-call parsers per model family, on text fixtures fed whole and one character at a
time: the calls (names, arguments that parse as JSON) and the content left around them
are the same either way, and no call is left in the content."""

from __future__ import annotations

import json

import pytest

from llmctl.server.tool_parsers import (
    CallArguments,
    CallStart,
    Content,
    ToolCallParser,
    family_for_template,
)


def parse(family: str, text: str, piece: int | None) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from ``text`` fed in pieces of ``piece`` chars."""
    parser = ToolCallParser(family)
    events = []
    step = piece or len(text) or 1
    for start in range(0, len(text), step):
        events += parser.feed(text[start : start + step])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.fragment
    return content, [tuple(call) for call in calls]


WEATHER = {"city": "Paris", "days": [1, 2], "note": 'say "hi" {not a bracket}'}

FIXTURES = {
    "hermes": [
        (
            f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n'
            "</tool_call>",
            "",
            [("get_weather", WEATHER)],
        ),
        (
            'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": [1, {"y": null}]}}\n</tool_call>',
            "Let me check.",
            [("a", {}), ("b", {"x": [1, {"y": None}]})],
        ),
        ("No tools needed: 2 < 3 and <tool is not a tag.", None, []),
        ("<tool_call>\nnot json at all\n</tool_call>", None, []),
    ],
    "llama3_json": [
        (
            f'{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}',
            "",
            [("get_weather", WEATHER)],
        ),
        (
            '{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {"m": 2}}',
            "",
            [("a", {"n": 1}), ("b", {"m": 2})],
        ),
        ('The answer is {"name": "x"} in text.', None, []),
        ('{"title": "a plain JSON answer"}', None, []),
    ],
    "mistral": [
        (
            f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}]',
            "",
            [("get_weather", WEATHER)],
        ),
        (
            'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"q": "]"}}, '
            '{"name": "b", "arguments": {}}]',
            "Sure.",
            [("a", {"q": "]"}), ("b", {})],
        ),
        ("Plain [TOOL answer", None, []),
    ],
}


@pytest.mark.parametrize(
    "family, text, content, calls",
    [(family, *case) for family, cases in FIXTURES.items() for case in cases],
)
def test_calls_and_content_are_the_same_whole_and_char_by_char(
    family, text, content, calls
) -> None:
    whole = parse(family, text, None)
    assert parse(family, text, 1) == whole
    assert parse(family, text, 3) == whole
    got_content, got_calls = whole
    assert got_content == (text if content is None else content)
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


def test_a_call_cut_short_keeps_its_arguments_so_far() -> None:
    content, calls = parse("hermes", '<tool_call>{"name": "f", "arguments": {"a": "unfin', 1)
    assert content == "" and calls == [("f", '{"a": "unfin')]


def test_the_family_comes_from_the_template() -> None:
    assert family_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert family_for_template("<|python_tag|>{{ x }} ipython") == "llama3_json"
    assert family_for_template("<tool_call>") == "hermes"
    assert family_for_template(None) == "hermes"
