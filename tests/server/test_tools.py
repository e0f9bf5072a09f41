"""Tool calling through a real ``llmctl serve`` (the demo model with a Qwen2.5-style
template) and the ``openai`` client: ``tool_choice`` required and named give calls that
parse and validate, streamed and not; a tool result fed back gives an answer; bad tool
requests are 400s and the server keeps serving."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time now", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture
def client(demo_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_url, api_key="none", max_retries=0, timeout=120)


def check_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list[dict], str, str | None]:
    """Join streamed tool-call deltas by index, as the openai client's users do."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert call["id"] is None, "a call's id and name come once, first"
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], content, reason


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_valid_calls_whole_and_streamed(client, seed) -> None:
    ask = dict(
        model="demo",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=seed,
        max_tokens=300,
    )
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    assert not choice.message.content
    calls, content, reason = streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert reason == "tool_calls" and content == ""
    # The same seed: the stream joins to exactly the whole answer.
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_a_named_function_is_the_one_called_whole_and_streamed(client) -> None:
    ask = dict(
        model="demo",
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=5,
    )
    answer = client.chat.completions.create(**ask)
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 1
    check_calls(calls, names=["get_time"])
    streamed, content, reason = streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (calls[0].function.name, calls[0].function.arguments)
    ]


def test_feeding_the_tool_result_back_gives_an_answer(client) -> None:
    first = client.chat.completions.create(
        model="demo", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    final = client.chat.completions.create(
        model="demo", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None
    # The template rendered the call and its result: the prompt grew by both.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + len('{"temp_c": 21}')


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not among the tools",
        ),
        ({"tools": TOOLS, "n": 2}, "n", "n = 1"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            "drop response_format",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "bad", "parameters": {"type": "integer", "not": {}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "'not'",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "must not set"),
    ],
)
def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(
    client, extra, param, words
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="demo", messages=QUESTION, max_tokens=5, extra_body=extra
        )
    error = caught.value.body
    assert words in error["message"] and error["param"] == param, error
    ok = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_chat_template_kwargs_reach_the_template(client) -> None:
    plain = client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=1)
    no_thinking = client.chat.completions.create(
        model="demo",
        messages=QUESTION,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    # The template adds an empty <think></think> block when thinking is off.
    assert no_thinking.usage.prompt_tokens > plain.usage.prompt_tokens


def test_auto_reads_a_call_out_of_the_content_streamed_and_whole(client) -> None:
    # The random model is made to write a Hermes call by a choice grammar; with
    # tool_choice auto the server must read it out of the text, never leave it there.
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    ask = dict(
        model="demo",
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=120,
        extra_body={"structured_outputs": {"choice": [text]}},
    )
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.message.content == "Sure."
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "CET"},
    )
    calls, content, reason = streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert (content, reason) == ("Sure.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]
