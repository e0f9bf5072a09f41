"""Malformed requests get a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import SESSION_LEN, Server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, method, path, request kwargs for httpx, status, param, words the message must contain)
CASES: list[tuple[str, str, str, dict[str, Any], int, str | None, list[str]]] = [
    ("bad json", "POST", COMPLETIONS, {"content": b'{"prompt": "x",'}, 400, None, ["JSON"]),
    ("json not an object", "POST", COMPLETIONS, {"json": ["x"]}, 400, None, ["JSON object"]),
    (
        "json sent as a form",
        "POST",
        COMPLETIONS,
        {
            "content": b'{"prompt": "x"}',
            "headers": {"content-type": "application/x-www-form-urlencoded"},
        },
        400,
        None,
        ["a JSON object but was sent as Content-Type 'application/x-www-form-urlencoded'"],
    ),
    (
        "unterminated string",
        "POST",
        COMPLETIONS,
        {"content": b'{"prompt": "x', "headers": {"content-type": "application/json"}},
        400,
        None,
        ["Unterminated string starting at character 11"],
    ),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        {"json": {"messages": USER, "stream_options": {"include_usage": True}}},
        400,
        "stream_options",
        ["stream_options", "stream: true"],
    ),
    (
        "not json content type",
        "POST",
        COMPLETIONS,
        {"content": b"prompt=x", "headers": {"content-type": "text/plain"}},
        400,
        None,
        ["Content-Type"],
    ),
    (
        "max_tokens a string",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": "x", "max_tokens": "ten"}},
        400,
        "max_tokens",
        ["max_tokens", "integer"],
    ),
    (
        "temperature a string",
        "POST",
        CHAT,
        {"json": {"messages": USER, "temperature": "hot"}},
        400,
        "temperature",
        ["temperature"],
    ),
    ("prompt a number", "POST", COMPLETIONS, {"json": {"prompt": 5}}, 400, "prompt", ["prompt"]),
    (
        "messages not a list",
        "POST",
        CHAT,
        {"json": {"messages": "hi"}},
        400,
        "messages",
        ["messages"],
    ),
    (
        "message without role",
        "POST",
        CHAT,
        {"json": {"messages": [{"content": "hi"}]}},
        400,
        "messages",
        ["role", "required"],
    ),
    (
        "negative max_tokens",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": "x", "max_tokens": -5}},
        400,
        "max_tokens",
        ["max_tokens", "-5"],
    ),
    (
        "top_p out of range",
        "POST",
        CHAT,
        {"json": {"messages": USER, "top_p": 1.5}},
        400,
        "top_p",
        ["top_p", "1.5"],
    ),
    (
        "unknown model",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": "x", "model": "gpt-4o"}},
        404,
        "model",
        ["gpt-4o"],
    ),
    ("missing messages", "POST", CHAT, {"json": {"max_tokens": 3}}, 400, "messages", ["messages"]),
    ("missing prompt", "POST", COMPLETIONS, {"json": {"max_tokens": 3}}, 400, "prompt", ["prompt"]),
    ("empty messages", "POST", CHAT, {"json": {"messages": []}}, 400, "messages", ["messages"]),
    (
        "over-long prompt",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": [5] * 600, "max_tokens": 4}},
        400,
        None,
        ["600", "4", str(SESSION_LEN)],
    ),
    (
        "prompt plus max_tokens too long",
        "POST",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 500}},
        400,
        None,
        ["500", str(SESSION_LEN)],
    ),
    (
        "max_tokens beyond the session",
        "POST",
        CHAT,
        {"json": {"messages": USER, "max_tokens": 1000, "max_completion_tokens": 5}},
        400,
        "max_tokens",
        ["1000", str(SESSION_LEN)],
    ),
    (
        "token id outside the vocabulary",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": [1, 99999]}},
        400,
        None,
        ["99999"],
    ),
    ("n too large", "POST", COMPLETIONS, {"json": {"prompt": "x", "n": 17}}, 400, "n", ["16"]),
    (
        "too many stop strings",
        "POST",
        CHAT,
        {"json": {"messages": USER, "stop": [str(i) for i in range(17)]}},
        400,
        "stop",
        ["16"],
    ),
    (
        "stop string too long",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": "x", "stop": "s" * 257}},
        400,
        "stop",
        ["256"],
    ),
    (
        "too many stop token ids",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": "x", "stop_token_ids": list(range(257))}},
        400,
        "stop_token_ids",
        ["256"],
    ),
    (
        "min_tokens above max_tokens",
        "POST",
        COMPLETIONS,
        {"json": {"prompt": "x", "max_tokens": 3, "min_tokens": 5}},
        400,
        "min_tokens",
        ["min_tokens", "5", "3"],
    ),
    (
        "a temperature that is not finite",
        "POST",
        COMPLETIONS,
        {"content": b'{"prompt": "x", "temperature": NaN}'},
        400,
        "temperature",
        ["finite"],
    ),
    (
        "unsupported field",
        "POST",
        CHAT,
        {"json": {"messages": USER, "functions": [{"name": "f"}]}},
        400,
        "functions",
        ["functions"],
    ),
    (
        "top_logprobs without logprobs",
        "POST",
        CHAT,
        {"json": {"messages": USER, "top_logprobs": 2}},
        400,
        "top_logprobs",
        ["logprobs"],
    ),
    (
        "oversized body",
        "POST",
        COMPLETIONS,
        {"content": json.dumps({"prompt": "a" * (9 * 2**20)}).encode()},
        413,
        None,
        ["limit"],
    ),
    ("wrong method", "GET", COMPLETIONS, {}, 405, None, ["Method"]),
    ("unknown route", "POST", "/v1/embeddings", {"json": {}}, 404, None, ["Not Found"]),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "param", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_malformed_request_gets_openai_error(
    server: Server,
    method: str,
    path: str,
    kwargs: dict[str, Any],
    status: int,
    param: str | None,
    words: list[str],
) -> None:
    with server.client() as http:
        kwargs = {**kwargs}
        headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
        response = http.request(method, path, headers=headers, **kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
        for word in words:
            assert word in error["message"], error["message"]
        # ... and the server still answers everyone else.
        ok = http.post(COMPLETIONS, json={"prompt": "Once", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_errors_do_not_leak_kv_blocks(server: Server) -> None:
    with server.client() as http:
        http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2})  # warm up
        assert server.metric("llmctl_num_requests_running") == 0
        used = server.metric("llmctl_kv_blocks_used")
        for _ in range(3):
            http.post(COMPLETIONS, json={"prompt": [5] * 600})
            http.post(COMPLETIONS, json={"prompt": "x", "n": 4, "max_tokens": 1000})
    assert server.metric("llmctl_kv_blocks_used") == used


def test_an_unknown_model_is_model_not_found(server: Server) -> None:
    response = httpx.post(
        f"{server.url}{CHAT}",
        json={"messages": USER, "model": "nope"},
        headers={"Authorization": f"Bearer {server.api_key}"},
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
