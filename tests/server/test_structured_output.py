"""Structured output through a real ``llmctl serve`` (the demo model: random weights) and
the ``openai`` client: every answer parses and validates with ``jsonschema`` at
temperature 1; bad grammars are 400s that name the problem, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.json_schemas import SCHEMAS


@pytest.fixture
def url(demo_url) -> str:
    return demo_url


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def ask(**kwargs) -> dict:
    return dict(model="demo", messages=[{"role": "user", "content": "Answer in JSON."}], **kwargs)


def test_every_schema_validates_at_temperature_one_in_one_batch(url) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)

    async def one(name: str, seed: int):
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        }
        return name, await client.chat.completions.create(
            **ask(response_format=response_format, temperature=1.0, seed=seed, n=2),
            max_tokens=400,
        )

    async def main():
        return await asyncio.gather(*(one(name, seed) for name in SCHEMAS for seed in (1, 2)))

    for name, answer in asyncio.run(main()):
        assert len(answer.choices) == 2
        for choice in answer.choices:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


class Route(BaseModel):
    label: str = Field(max_length=5)
    start: Point
    stops: list[Point] = Field(max_length=2)


def test_the_openai_client_parses_a_pydantic_model(client) -> None:
    completion = client.chat.completions.parse(
        **ask(response_format=Route, temperature=1.0, seed=4), max_tokens=300
    )
    route = completion.choices[0].message.parsed
    assert isinstance(route, Route)
    assert 0 <= route.start.x <= 9


def test_streamed_json_object_joins_to_json(client) -> None:
    stream = client.chat.completions.create(
        **ask(response_format={"type": "json_object"}, temperature=0.7, seed=3),
        max_tokens=600,
        stream=True,
        logprobs=True,
    )
    parts, logprobs = [], 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].logprobs:
            logprobs += len(chunk.choices[0].logprobs.content)
    value = json.loads("".join(parts))
    assert isinstance(value, dict)
    assert logprobs > 0


def test_vllm_structured_outputs_regex_choice_grammar(client) -> None:
    regex = client.chat.completions.create(
        **ask(extra_body={"structured_outputs": {"regex": "[A-F]{3}-[0-9]{2}"}}), max_tokens=20
    )
    assert re.fullmatch("[A-F]{3}-[0-9]{2}", regex.choices[0].message.content)
    choice = client.completions.create(
        model="demo",
        prompt="Pick one:",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta", "γ"]}},
    )
    assert choice.choices[0].text in ("alpha", "beta", "γ")
    grammar = 'root ::= "(" digit ("," digit)* ")"\ndigit ::= [0-9]'
    gbnf = client.chat.completions.create(
        **ask(extra_body={"structured_outputs": {"grammar": grammar}}, seed=1), max_tokens=40
    )
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", gbnf.choices[0].message.content)
    lark = 'start: "(" DIGIT ("," DIGIT)~0..4 ")"\n%import common.DIGIT'
    answer = client.completions.create(
        model="demo",
        prompt="Digits:",
        max_tokens=40,
        seed=2,
        extra_body={"structured_outputs": {"grammar": lark}},
    )
    assert re.fullmatch(r"\([0-9](,[0-9]){0,4}\)", answer.choices[0].text)


def test_unconstrained_requests_get_their_tokens_alone(url) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    plain = dict(prompt="Once upon", max_tokens=24, temperature=1.0, seed=11)

    async def main():
        alone = await client.completions.create(model="demo", **plain)
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["refs"]}}
        mixed = await asyncio.gather(
            client.completions.create(model="demo", **plain),
            *(
                client.chat.completions.create(**ask(response_format=fmt, seed=s), max_tokens=200)
                for s in range(4)
            ),
            client.completions.create(
                model="demo",
                prompt="x",
                max_tokens=20,
                extra_body={"structured_outputs": {"regex": "[0-9]+"}},
            ),
        )
        return alone, mixed

    alone, mixed = asyncio.run(main())
    assert mixed[0].choices[0].text == alone.choices[0].text


def test_logit_bias_forces_a_token(client) -> None:
    # Token 3 + 65 is "A" in the demo's byte vocabulary (3 special tokens, then bytes).
    answer = client.completions.create(
        model="demo", prompt="x", max_tokens=6, temperature=1.0, logit_bias={"68": 100}
    )
    assert answer.choices[0].text == "AAAAAA"


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
            "does not compile",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
                }
            },
            "response_format",
            "'not'",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
        (
            {"structured_outputs": {"grammar": 'start: "a" missing'}},
            "structured_outputs",
            "Lark grammar does not compile: Lark error at line 1, column 12: unknown name 'missing'",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs"),
        ({"logit_bias": {"99999": 5}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": 500}}, "logit_bias", "100"),
    ],
)
def test_bad_grammars_are_400s_and_the_server_keeps_serving(client, body, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask(extra_body=body), max_tokens=10)
    error = caught.value.body
    assert words in error["message"], error
    assert (error.get("param") or "").startswith(param.split(".")[0]), error
    ok = client.chat.completions.create(**ask(), max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")
