"""Every error the server answers, in OpenAI's shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` whatever went
wrong: bad JSON, a field of the wrong type, an unknown model, a request the engine
refuses, a missing API key, a full queue. Clients written for OpenAI read the message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from llmctl.errors import EngineDead, EngineError, InvalidRequest, LlmctlError, UpstreamError


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)

    async def send(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer directly from ASGI middleware, before any route runs."""
        await self.response()(scope, receive, send)


def api_error_for(exc: Exception) -> APIError:
    """The answer for an exception from the engine: the client's fault (400, naming the
    field), the upstream's (502, proxy engines), a dead engine (503) or ours (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest) and exc.code == "model_not_found":
        return APIError(404, str(exc), param=exc.param, code=exc.code)  # an adapter gone
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param, code=exc.code or "invalid_request")
    if isinstance(exc, UpstreamError):
        return APIError(502, str(exc), type="upstream_error", code="upstream_error")
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Turn every exception a route can raise into an OpenAI-shaped answer.

    Expected errors get their own handlers; Starlette treats the ``Exception`` handler
    as a last resort (it answers, then re-raises so the traceback is logged).
    """

    async def known_error(_: Request, exc: Exception) -> JSONResponse:
        return api_error_for(exc).response()

    app.add_exception_handler(APIError, known_error)
    app.add_exception_handler(LlmctlError, known_error)
    app.add_exception_handler(Exception, known_error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors())
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type.lower() and _is_json_object(await request.body()):
            # A JSON body under another type (curl -d sends a form type): say so exactly.
            sent = f"as Content-Type {content_type!r}" if content_type else "without a Content-Type"
            message = (
                f"the request body is a JSON object but was sent {sent}: send it with the "
                "header `Content-Type: application/json`"
            )
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing errors; a 405 keeps Starlette's ``Allow`` header, as HTTP requires.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


# Readable descriptions of the fields whose type is a union, where pydantic would list
# one complaint per alternative.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def _is_json_object(body: bytes) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


def describe_validation_errors(errors: list[Mapping[str, Any]]) -> tuple[str, str | None]:
    """One sentence naming the offending field, from pydantic's error list."""
    first = errors[0]
    loc = [part for part in first["loc"] if part != "body"]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        where = ""
        if loc and isinstance(loc[0], int):  # json's own messages may end in "starting at"
            where = f"{'' if detail.endswith(' at') else ' at'} character {loc[0]}"
        return f"the request body is not valid JSON: {detail}{where}".rstrip(": "), None
    if not loc:
        return (
            "the request body must be a JSON object, sent with the header "
            "`Content-Type: application/json`",
            None,
        )
    path = _readable(first["loc"])
    field, param = ".".join(path), path[0]
    if first["type"] == "extra_forbidden":  # the last part is the unknown key, whatever it is
        field = ".".join([*_readable(first["loc"][:-1]), str(first["loc"][-1])])
        return f"unknown field '{field}': this server does not support it", param
    if first["type"] == "missing":
        return f"'{field}' is required", param
    # A union (prompt, stop, content) gets one error per alternative; one that is not a
    # type mismatch says what is wrong inside the alternative the client meant.
    alternatives = [e for e in errors if _readable(e["loc"])[: len(path)] == path]
    meant = next((e for e in alternatives if not e["type"].endswith("_type")), None)
    if meant is not None:
        where = ".".join(_readable(meant["loc"]))
        return f"'{where}': {meant['msg']} (got {_short(meant.get('input'))})", param
    leaf = next((p for p in reversed(path) if not p.isdigit()), param)
    if len(alternatives) > 1 and leaf in _EXPECTED:
        return f"'{field}' must be {_EXPECTED[leaf]}, got {_short(first.get('input'))}", param
    return f"'{field}': {first['msg']} (got {_short(first.get('input'))})", param


def _readable(loc: tuple[Any, ...]) -> list[str]:
    """The path of a field, without "body" and pydantic's union tags ("list[int]", ...).
    The first part is always a field of the body."""
    parts = [p for p in loc if p != "body"]
    return [
        str(p) for i, p in enumerate(parts) if not i or isinstance(p, int) or not _is_type_tag(p)
    ]


def _is_type_tag(part: str) -> bool:
    return not part.isidentifier() or part in {"str", "int", "float", "bool", "list"}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
