"""A chat connection to any OpenAI-compatible server (llmctl's own included)."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import httpx

from llmctl.chat.connection import Delta, NoChatTemplate
from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import LlmctlError


class ServerError(LlmctlError):
    """The remote server cannot be reached, refused the request or failed mid-answer.
    ``code`` is the OpenAI error code the server gave (``context_length_exceeded``)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class RemoteConnection:
    """Talks to ``/v1/chat/completions`` (or ``/v1/completions``) with ``stream: true``."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        model: str | None = None,
        ca_cert: str | None = None,
    ) -> None:
        """``ca_cert``: a PEM file of the CA that signed an https server's certificate
        (a private CA); without it the system's CAs are trusted."""
        self.base_url = check_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        verify = tls_context(ca_cert)
        entry = _model_entry(self.base_url, headers, model, verify)
        self.model_name = model or entry["id"]
        # llmctl's server says whether the model has a chat template; other servers do
        # not (they refuse chat messages instead, which ChatSession.ask handles).
        self.has_chat_template = entry.get("chat_template") is not False
        self._continuous_usage = True  # until the server refuses it (see stream)
        # No read timeout: an answer may wait in the server's queue before its first token.
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(30.0, read=None),
            verify=verify,
        )

    async def stream(
        self,
        sampling: SamplingParams,
        messages: list[dict[str, str]] | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[Delta]:
        # vLLM's and llmctl's continuous_usage_stats put the usage on every chunk, so an
        # answer stopped with Ctrl-C still counts tokens; a server that refuses the field
        # is asked once more without it (then a stopped answer counts chunks).
        while True:
            body: dict[str, Any] = {
                "model": self.model_name,
                "stream": True,
                "stream_options": {
                    "include_usage": True,
                    **({"continuous_usage_stats": True} if self._continuous_usage else {}),
                },
                **_sampling_fields(sampling),
            }
            if messages is not None:
                path, body["messages"] = "/v1/chat/completions", messages
            else:
                path, body["prompt"] = "/v1/completions", prompt
            try:
                # Leaving this block closes the HTTP stream, which tells the server to stop.
                async with self.client.stream("POST", path, json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        message = _error_text(response)
                        if self._continuous_usage and "continuous_usage_stats" in message:
                            self._continuous_usage = False
                            continue
                        if (
                            response.status_code == 400
                            and messages is not None
                            and "no chat template" in message.lower()
                        ):
                            raise NoChatTemplate(message)
                        raise ServerError(
                            _http_error(self.base_url, response.status_code, message),
                            code=_error_code(response),
                        )
                    async with aclosing(_sse_events(response)) as events:
                        async for event in events:
                            yield chunk_delta(event)
                    return
            except httpx.HTTPError as exc:
                raise ServerError(f"lost the connection to {self.base_url}: {exc}") from None

    async def stats(self) -> list[tuple[str, str]]:
        try:
            response = await self.client.get("/metrics")
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach {self.base_url}/metrics: {exc}") from None
        if response.status_code != 200:
            raise ServerError(
                _http_error(self.base_url, response.status_code, _error_text(response))
            )
        return summarize_metrics(response.text)

    async def close(self) -> None:
        await self.client.aclose()


def check_url(url: str) -> str:
    """The server root, ``http://host:port``, from that, a trailing ``/`` or ``/v1``."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ServerError(f"--url {url!r} must start with http:// or https://")
    return base.removesuffix("/v1")


def tls_context(ca_cert: str | None) -> ssl.SSLContext | bool:
    """What httpx verifies an https server with: the CA in ``ca_cert``, else the system's."""
    if ca_cert is None:
        return True
    try:
        return ssl.create_default_context(cafile=ca_cert)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise ServerError(
            f"--ca-cert {ca_cert}: not a readable PEM CA certificate ({reason})"
        ) from None


def _model_entry(
    base_url: str, headers: dict[str, str], model: str | None, verify: ssl.SSLContext | bool
) -> dict[str, Any]:
    """The server's ``/v1/models`` entry for ``model``, or for the model it serves when it
    serves exactly one (else ask for --model). A named model the list lacks (a server
    that lists few) gets a bare entry."""
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, verify=verify)
    except httpx.HTTPError as exc:
        if "CERTIFICATE_VERIFY_FAILED" in str(exc):
            raise ServerError(
                f"{base_url}'s certificate is not trusted here ({exc}): pass the CA that "
                "signed it with --ca-cert FILE"
            ) from None
        raise ServerError(
            f"cannot reach {base_url}: {exc}. Is the server running (`llmctl serve`)?"
        ) from None
    if response.status_code in (401, 403) or (response.status_code != 200 and model is None):
        raise ServerError(_http_error(base_url, response.status_code, _error_text(response)))
    try:
        entries = [entry for entry in response.json()["data"] if "id" in entry]
    except (ValueError, KeyError, TypeError):
        if model is not None:  # the model is named: the list was only for its facts
            return {"id": model}
        raise ServerError(
            f"{base_url}/v1/models did not answer an OpenAI-style model list: is this an "
            "OpenAI-compatible server?"
        ) from None
    if model is not None:
        return next((entry for entry in entries if entry["id"] == model), {"id": model})
    if len(entries) != 1:
        listed = ", ".join(entry["id"] for entry in entries) if entries else "none"
        raise ServerError(f"{base_url} serves {listed}: name the model with --model NAME")
    return entries[0]


def _sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
    }
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    if sampling.top_k > 0:  # not in OpenAI's API: send it only when asked for
        fields["top_k"] = sampling.top_k
    return fields


async def _sse_events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``."""
    async with aclosing(response.aiter_lines()) as lines:
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError:
                raise ServerError(f"the server sent an event that is not JSON: {data!r}") from None
            if "error" in event:
                raise ServerError(f"the server failed mid-answer: {_message_of(event)}")
            yield event


def chunk_delta(event: dict[str, Any]) -> Delta:
    """A chat (``delta.content``) or completions (``text``) chunk, with usage if present."""
    delta = Delta()
    for choice in event.get("choices") or []:
        delta.text += choice.get("delta", {}).get("content") or choice.get("text") or ""
        delta.finish_reason = choice.get("finish_reason") or delta.finish_reason
    if usage := event.get("usage"):
        delta.completion_tokens = usage.get("completion_tokens")
    return delta


def _error_text(response: Any) -> str:
    try:
        return _message_of(response.json())
    except ValueError:
        return response.text.strip() or response.reason_phrase


def _error_code(response: Any) -> str | None:
    """The ``code`` of an OpenAI-style error body, if any."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _message_of(body: Any) -> str:
    """The message of an OpenAI-style ``{"error": {"message": ...}}`` or FastAPI body."""
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)
    return str(body)


def _http_error(base_url: str, status: int, message: str) -> str:
    if status in (401, 403):
        return (
            f"{base_url} refused the API key (HTTP {status}): {message}. "
            "Pass the server's key with --api-key (or LLMCTL_API_KEY)"
        )
    return f"{base_url} answered HTTP {status}: {message}"


def summarize_metrics(text: str) -> list[tuple[str, str]]:
    """The samples of a Prometheus text page worth a glance: no buckets, no process_/python_."""
    rows = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base.startswith(("process_", "python_")) or base.endswith(("_bucket", "_created")):
            continue
        rows.append((name, value))
    return rows
