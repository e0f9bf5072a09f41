"""API keys: none, wrong and right ones; the open endpoints; auth comes before parsing."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import Server


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Basic dGVzdA=="}],
    ids=["no key", "wrong key", "wrong scheme"],
)
@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions"])
def test_without_the_right_key_is_401(server: Server, headers: dict, path: str) -> None:
    method = "GET" if path == "/v1/models" else "POST"
    response = httpx.request(
        method, f"{server.url}{path}", headers=headers, json={"prompt": "x", "max_tokens": 1}
    )
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in error["message"]


def test_the_right_key_is_served(server: Server) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    response = httpx.post(
        f"{server.url}/v1/completions", headers=headers, json={"prompt": "x", "max_tokens": 1}
    )
    assert response.status_code == 200


def test_openai_client_with_a_wrong_key_gets_authentication_error(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_auth_is_checked_before_the_body_is_read(server: Server) -> None:
    bad_json = httpx.post(f"{server.url}/v1/completions", content=b"{not json")
    assert bad_json.status_code == 401
    huge = httpx.post(f"{server.url}/v1/completions", content=b"x" * (9 * 2**20))
    assert huge.status_code == 401


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics"])
def test_open_endpoints(server: Server, path: str) -> None:
    assert httpx.get(f"{server.url}{path}").status_code == 200
