"""Talking to the upstream server outside generation: its model list, and its errors.

Which upstream failures are whose fault decides the status a client of the proxy gets:
- a 4xx about the request itself (bad parameter, prompt too long) is the client's:
  ``InvalidRequest`` with the upstream's message, which the server turns into a 400;
- everything else (unreachable, timeout, 5xx, a rejected proxy key, an unknown model
  or endpoint, rate limiting) is the upstream's or the operator's: ``UpstreamError``,
  which the server turns into a 502.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from llmctl.errors import InvalidRequest, LlmctlError, UpstreamError
from llmctl_openai_proxy.config import ProxyConfig

# `llmctl backends check` and `--backend auto` must answer quickly even when the
# upstream accepts connections but never answers.
PROBE_TIMEOUT_S = 10.0
# Statuses that are not about the client's request, though they are 4xx.
NOT_THE_CLIENTS_FAULT = {
    401: "check --proxy-api-key",
    403: "check --proxy-api-key",
    404: "check --proxy-url and the model name",
    408: "the upstream timed out",
    429: "the upstream is overloaded or rate-limited",
}


def list_models(config: ProxyConfig, timeout: float | None = None) -> list[dict[str, Any]]:
    """The upstream's ``GET /v1/models`` entries (each has at least an ``id``)."""
    url = f"{config.api_root}/models"
    timeout = config.timeout if timeout is None else timeout
    try:
        response = httpx.get(
            url,
            headers=config.headers(),
            timeout=httpx.Timeout(timeout, connect=min(config.connect_timeout, timeout)),
        )
    except httpx.HTTPError as exc:
        raise transport_error(config, exc) from None
    if response.status_code >= 400:
        raise status_error(config, response.status_code, response.text)
    try:
        models = response.json()["data"]
        if not all(isinstance(card, dict) and "id" in card for card in models):
            raise ValueError("an entry has no id")
    except (ValueError, KeyError, TypeError) as exc:
        raise UpstreamError(
            f"upstream {url} is not an OpenAI-compatible API: its model list is malformed "
            f"({exc}); check --proxy-url"
        ) from None
    return models


def probe(config: ProxyConfig) -> str | None:
    """Why the upstream cannot be used right now, or None when it answers its model list."""
    try:
        list_models(config, timeout=min(config.timeout, PROBE_TIMEOUT_S))
    except LlmctlError as exc:
        return str(exc)
    return None


def transport_error(config: ProxyConfig, exc: httpx.HTTPError) -> UpstreamError:
    """The upstream could not be reached, or stopped answering."""
    if isinstance(exc, httpx.TimeoutException):
        what = "connect to" if isinstance(exc, httpx.ConnectTimeout) else "get an answer from"
        return UpstreamError(
            f"could not {what} upstream {config.api_root} in time ({type(exc).__name__}); "
            "raise --proxy-timeout / --proxy-connect-timeout if it is just slow"
        )
    detail = str(exc) or type(exc).__name__
    return UpstreamError(f"upstream {config.api_root} is unreachable: {detail}")


def status_error(config: ProxyConfig, status: int, body: str) -> LlmctlError:
    """Map an upstream HTTP error status to the error the proxy's own server reports."""
    message = error_message(body)
    if 400 <= status < 500 and status not in NOT_THE_CLIENTS_FAULT:
        return InvalidRequest(message)
    hint = NOT_THE_CLIENTS_FAULT.get(status, "the upstream server failed")
    return UpstreamError(f"upstream {config.api_root} answered HTTP {status}: {message} ({hint})")


def error_message(body: str) -> str:
    """The human message inside an error body, whichever server framework sent it."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.strip()[:500] or "(empty body)"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):  # OpenAI, llmctl
            return str(error["message"])
        for key in ("message", "detail", "error"):  # vLLM's older shape, FastAPI's default
            if payload.get(key):
                return str(payload[key])
    return body.strip()[:500]
