"""The OpenAPI document states the rules between fields: where JSON Schema can
(``dependentSchemas``) a validator built from the document accepts exactly the bodies the
server accepts; every other rule is listed in the route's 400 with its error code."""

from __future__ import annotations

import itertools
import random

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.server.conftest import Server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def document(server: Server) -> dict:
    with server.client() as client:
        return client.get("/openapi.json").json()


def validator(document: dict, name: str) -> jsonschema.protocols.Validator:
    """A JSON Schema 2020-12 validator for one request body, its $refs into the document."""
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:doc", resource)
    schema = {"$ref": f"urn:doc#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def bodies(path: str) -> list[dict]:
    """Every combination of the fields the rules tie together, in a random order."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    base["max_tokens"] = 2
    combos = []
    logprob_values = [None, False, True] if path == CHAT else [None]
    top_values = [None, 0, 2] if path == CHAT else [None]
    for logprobs, top, stream, options in itertools.product(
        logprob_values, top_values, [None, False, True], [None, {"include_usage": True}]
    ):
        body = dict(base)
        for key, value in (
            ("logprobs", logprobs),
            ("top_logprobs", top),
            ("stream", stream),
            ("stream_options", options),
        ):
            if value is not None:
                body[key] = value
        combos.append(body)
    random.shuffle(combos)
    return combos


@pytest.mark.parametrize(
    ("path", "name"), [(CHAT, "ChatCompletionRequest"), (COMPLETIONS, "CompletionRequest")]
)
def test_the_schema_accepts_exactly_what_the_server_accepts(server, document, path, name):
    check = validator(document, name)
    with server.client() as client:
        for body in bodies(path):
            valid = check.is_valid(body)
            answer = client.post(path, json=body)
            assert answer.status_code == (200 if valid else 400), (body, answer.text)
            if not valid:
                assert answer.json()["error"]["code"] == "invalid_combination"


@pytest.mark.parametrize(
    ("path", "words"),
    [
        (COMPLETIONS, ["`min_tokens` <= `max_tokens` (`invalid_combination`)", "prompts x `n`"]),
        (CHAT, ["`min_tokens` <= `max_tokens`", "`top_logprobs` only with `logprobs: true`"]),
    ],
)
def test_every_other_rule_is_a_documented_400_with_its_code(document, path, words):
    description = document["paths"][path]["post"]["responses"]["400"]["description"]
    assert "context_length_exceeded" in description
    for piece in words:
        assert piece in description
