"""The contract /openapi.json publishes is the one the server keeps: checked by
schemathesis (an independent tool, every check on) against a live ``llmctl serve``,
and by reading the document for what a client needs to know."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llmctl.server.protocol import ChatCompletionRequest, CompletionRequest
from scripts.fuzz_api import run_schemathesis
from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server
from tests.server.conftest import QUIET_THREADS, stories_or_skip

KEY = "contract-key-7f2e"
SESSION_LEN = 64  # short answers keep each generated case cheap


@pytest.fixture(scope="module")
def contract_server() -> Iterator[ServerProcess]:
    stories_or_skip()
    args = [str(STORIES), "--backend", "torch", "--api-key", KEY]
    server = start_server([*args, "--session-len", str(SESSION_LEN)], env=QUIET_THREADS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def document(contract_server: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{contract_server.url}/openapi.json").json()


def test_schemathesis_with_every_check_finds_nothing(
    contract_server: ServerProcess, document: dict[str, Any]
) -> None:
    operations = sum(len(methods) for methods in document["paths"].values())
    result = run_schemathesis(contract_server.url, KEY, max_examples=25, seed=19)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    generated = int(re.search(r"(\d+) generated", output).group(1))
    assert generated >= 300, output  # the coverage phase alone walks every field's bounds
    assert "No issues found" in output
    # the OpenAI routes, /health, /version, /metrics, /stats, /tokenize, /detokenize
    assert operations >= 9
    assert f"Tested: {operations}" in output  # every documented operation


def test_request_bodies_publish_every_field_with_its_bounds(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest):
        published = schemas[model.__name__]
        assert set(published["properties"]) == set(model.model_fields)
        assert published["additionalProperties"] is False
    fields = schemas["CompletionRequest"]["properties"]

    def bounds(name: str) -> dict[str, Any]:
        return next(c for c in fields[name]["anyOf"] if c.get("type") in ("integer", "number"))

    assert bounds("top_p").items() >= {"exclusiveMinimum": 0, "maximum": 1}.items()
    assert bounds("n")["maximum"] == 16
    assert bounds("max_tokens").items() >= {"minimum": 1, "maximum": SESSION_LEN}.items()
    assert bounds("temperature")["minimum"] == 0
    model = next(c for c in fields["model"]["anyOf"] if c.get("type") == "string")
    assert model["enum"] == [str(STORIES)]
    stop_list = next(c for c in fields["stop"]["anyOf"] if c.get("type") == "array")
    assert stop_list["maxItems"] == 16
    token_ids = [
        c for c in fields["prompt"]["anyOf"] if c.get("items", {}).get("type") == "integer"
    ]
    assert token_ids[0]["items"]["maximum"] == 511  # stories260K's vocabulary: 512


def test_every_error_status_is_documented_in_openai_shape(document: dict[str, Any]) -> None:
    paths = document["paths"]
    completions = paths["/v1/completions"]["post"]["responses"]
    assert set(completions) == {
        "200",
        "400",
        "401",
        "404",
        "408",
        "413",
        "429",
        "500",
        "502",
        "503",
    }
    for status, response in completions.items():
        if status != "200":
            schema = response["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "Retry-After" in completions["429"]["headers"]
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in document["components"]["schemas"]  # never answered
    assert paths["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    assert "security" not in paths["/health"]["get"]


def test_an_undeclared_method_gets_405_with_allow(contract_server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, allowed in (
        ("DELETE", "/v1/completions", "POST"),
        ("PUT", "/v1/models", "GET"),
        ("POST", "/health", "GET"),
    ):
        response = httpx.request(method, contract_server.url + path, headers=headers)
        assert response.status_code == 405
        assert allowed in response.headers["Allow"]
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_unknown_fields_are_refused_by_name_even_as_null(contract_server: ServerProcess) -> None:
    """The decision docs/server.md records: as OpenAI's own API does, a field the server
    does not know is a 400 naming it (a client must not believe it had an effect)."""
    url = f"{contract_server.url}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    for extra in ({"suffix": "!"}, {"best_of": None}):
        body = {"prompt": "Once", "max_tokens": 2, **extra}
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == next(iter(extra)) and next(iter(extra)) in error["message"]
    known_null = httpx.post(
        url, json={"prompt": "Once", "max_tokens": 2, "seed": None}, headers=headers
    )
    assert known_null.status_code == 200  # null: "not set", for every field the server knows


def test_a_whole_float_is_an_integer_a_string_is_not(contract_server: ServerProcess) -> None:
    url = f"{contract_server.url}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Once", "temperature": 0, "ignore_eos": True}
    whole = httpx.post(url, json={**body, "max_tokens": 3.0}, headers=headers, timeout=60)
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 3
    for bad in (3.5, "3", True):
        refused = httpx.post(url, json={**body, "max_tokens": bad}, headers=headers)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
