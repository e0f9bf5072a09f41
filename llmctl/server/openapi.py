"""The OpenAPI document the server publishes at ``/openapi.json``: the contract it keeps.

The request bodies come from ``protocol.py``; this module adds what FastAPI cannot know
by itself: the shapes of the answers (declared here as pydantic models, used only for
the document), every error status with OpenAI's error schema, and the facts of the
engine being served (the model's name, its session length and vocabulary, whether an
API key is needed). FastAPI's default 422 entries are dropped: this server answers a
malformed body with 400, as OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from llmctl.backend import capabilities
from llmctl.server.guard import GUARDED_PATHS
from llmctl.server.state import ServerState


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every status the server answers with an error."""

    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """With ``echo``, the prompt's tokens come first; the first one's entries are null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(description="1: the most likely token at that position.")
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None,
        description="With the request's prompt_logprobs (vLLM's): per prompt token, null "
        "for the first, token id -> its score, for the prompt's token and the alternatives.",
    )


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One event of a streamed completion; with ``include_usage``, ``usage`` is null on
    every chunk but the last, which has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null beside tool calls
    reasoning_content: str | None = None  # a thinking model's <think> text
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None,
        description="With the request's prompt_logprobs (vLLM's): per token of the rendered "
        "prompt, null for the first, token id -> its score.",
    )


class FunctionCallDelta(BaseModel):
    name: str | None = None  # on a call's first delta only
    arguments: str


class ToolCallDelta(BaseModel):
    """A call's first delta has its ``id``, ``type`` and name; the next ones carry the
    following fragments of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (``usage`` as in ``CompletionChunk``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    # llmctl's: false when the model has no chat template (chat messages are then joined
    # as plain text); `llmctl chat --url` switches to continuation mode on it.
    chat_template: bool | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


class Version(BaseModel):
    version: str
    backend: str


_WHEN = {
    501: "The backend cannot do this here (a proxy has no tokenizer of its own).",
    400: "The request is malformed or its values do not go together (`param` names the "
    "field): bad JSON, a wrong type, a value out of range, an unknown field "
    "(`invalid_value`); two fields that contradict each other (`invalid_combination`); "
    "prompt + max_tokens beyond the session length (`context_length_exceeded`); a grammar, "
    "regex or JSON schema that does not compile, or a schema keyword structured output "
    "cannot enforce (`invalid_grammar`, `unsupported_grammar`).",
    401: "No API key or a wrong one (`invalid_api_key`).",
    404: "`model` names a model this server does not serve (`model_not_found`).",
    408: "The client did not send its request body within the server's client_timeout.",
    413: "The request body is larger than the server's limit (`request_too_large`).",
    429: "The server is at capacity (`server_overloaded`); retry after `Retry-After` seconds.",
    500: "The engine failed while running this request (`engine_error`); the server goes on.",
    502: "A proxy backend's upstream server failed (`upstream_error`).",
    503: "The server is shutting down (`server_shutting_down`) or its engine has stopped "
    "(`engine_dead`).",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "`Bearer`"}},
    429: {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait."}},
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for a route: each status with OpenAI's error schema."""
    return {
        status: {"model": ErrorResponse, "description": _WHEN[status]}
        | ({"headers": _HEADERS[status]} if status in _HEADERS else {})
        for status in statuses
    }


# Every route under /v1 passes the gate: the body limit, the client timeout, draining.
GATE_ERRORS = (408, 413, 500, 503)
GENERATION_ERRORS = (400, 404, 429, 502, *GATE_ERRORS)


STREAM_CHUNKS = (CompletionChunk, ChatCompletionChunk)


def streamed_or_whole(
    model: type[BaseModel], chunk: type[BaseModel]
) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or, with ``"stream": true``, Server-Sent Events
    whose data is a ``chunk`` (or an error, if generation fails midway) and, last, the
    text ``[DONE]``. (Before OpenAPI 3.2, an event stream's schema describes one event.)"""
    chunk_json = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk.__name__), _ref(ErrorResponse.__name__)]},
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, chunk_json]}},
    }
    return {200: {"model": model, "content": {"text/event-stream": {"schema": event}}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def install_openapi(app: FastAPI, state: ServerState) -> None:
    """Serve the document described above at /openapi.json (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description="An OpenAI-compatible API served by llmctl (see docs/server.md).",
                routes=app.routes,
            )
            _drop_fastapi_validation_errors(schema)
            _add_models(schema["components"]["schemas"], STREAM_CHUNKS)
            _publish_engine_facts(schema["components"]["schemas"], state)
            _publish_field_rules(schema)
            if state.api_keys.required:
                _publish_auth(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_fastapi_validation_errors(schema: dict[str, Any]) -> None:
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)


def _add_models(components: dict[str, Any], models: tuple[type[BaseModel], ...]) -> None:
    """Models only event streams refer to (FastAPI adds those of JSON bodies itself)."""
    _, definitions = models_json_schema(
        [(model, "serialization") for model in models],
        ref_template="#/components/schemas/{model}",
    )
    components.update(definitions["$defs"])


def _publish_engine_facts(components: dict[str, Any], state: ServerState) -> None:
    """The served model's name, session length and vocabulary size, as bounds."""
    engine = state.engine
    session_len = engine.max_model_len  # 0: not known here (a proxy)
    vocab_size = capabilities(engine).vocab_size  # 0: not known here
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = components[name]["properties"]
        # Adapters loaded later are not in it (the schema is made at start).
        names = [engine.model_name, *capabilities(engine).lora_names()]
        _constrain(fields["model"], "string", enum=names)
        if session_len:
            for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
                if field in fields:
                    _constrain(fields[field], "integer", maximum=session_len)
    if vocab_size:
        for prompt in _choices(components["CompletionRequest"]["properties"]["prompt"]):
            items = prompt.get("items", {})
            items = items.get("items", items)  # a list of token-id lists
            if items.get("type") == "integer":
                items["maximum"] = vocab_size - 1
        detokenize = components.get("DetokenizeRequest")
        if detokenize is not None:
            detokenize["properties"]["tokens"]["items"]["maximum"] = vocab_size - 1
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            for bias in _choices(components[name]["properties"]["logit_bias"]):
                if bias.get("type") == "object":
                    bias["propertyNames"] = {"pattern": _below_pattern(vocab_size)}


def _below_pattern(limit: int) -> str:
    """A regex of the decimal numbers 0 .. limit - 1, without leading zeros (logit_bias
    keys are token ids as strings, so their bound can only be stated as a pattern)."""
    top = str(limit - 1)
    parts = ["0"]
    if len(top) > 1:
        parts.append("[1-9]" + (f"[0-9]{{0,{len(top) - 2}}}" if len(top) > 2 else ""))
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            parts.append(f"{top[:i]}[{low}-{int(digit) - 1}]{tail}")
    parts.append(top)
    return "^(" + "|".join(parts) + ")$"


def _allowed_only_with(field: str, needs: str, value: Any) -> dict[str, Any]:
    """``dependentSchemas`` entry: ``field`` (unless null or 0) needs ``needs: value``."""
    unset = {"anyOf": [{"type": "null"}, {"const": 0}, {"const": False}]}
    return {
        field: {
            "anyOf": [
                {"properties": {needs: {"const": value}}, "required": [needs]},
                {"properties": {field: unset}},
            ]
        }
    }


# Rules between fields that JSON Schema states (``dependentSchemas``), per request body.
_DEPENDENT = {
    "CompletionRequest": _allowed_only_with("stream_options", "stream", True),
    "ChatCompletionRequest": {
        **_allowed_only_with("top_logprobs", "logprobs", True),
        **_allowed_only_with("stream_options", "stream", True),
    },
}
# The rest, which JSON Schema cannot state, each answered with a 400 and this `code`.
_SHARED_RULES = [
    "`min_tokens` <= `max_tokens` (`invalid_combination`)",
    "prompt tokens + `max_tokens` <= the session length (`context_length_exceeded`)",
    "`stream_options` only with `stream: true` (`invalid_combination`)",
]
_CROSS_FIELD_RULES = {
    "/v1/completions": [
        *_SHARED_RULES,
        "prompts x `n` at most the per-request limit of generations (`invalid_combination`)",
    ],
    "/v1/chat/completions": [
        *_SHARED_RULES,
        "`top_logprobs` only with `logprobs: true` (`invalid_combination`)",
        "`prompt_logprobs` not with `stream: true`, as vLLM (`invalid_combination`)",
        "`max_completion_tokens` wins over `max_tokens`; `min_tokens` <= the one used "
        "(`invalid_combination`)",
    ],
}


def _publish_field_rules(schema: dict[str, Any]) -> None:
    """State each rule between fields: in the body's schema where JSON Schema can, and
    in the route's 400 description (with its error code) always."""
    components = schema["components"]["schemas"]
    for name, dependent in _DEPENDENT.items():
        components[name]["dependentSchemas"] = dependent
    for path, rules in _CROSS_FIELD_RULES.items():
        bad_request = schema["paths"][path]["post"]["responses"]["400"]
        listed = "; ".join(rules)
        bad_request["description"] += f" Rules between fields, each a 400 naming it: {listed}."


def _choices(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return prop.get("anyOf", [prop])


def _constrain(prop: dict[str, Any], json_type: str, **facts: Any) -> None:
    for choice in _choices(prop):
        if choice.get("type") == json_type:
            choice.update(facts)


def _publish_auth(schema: dict[str, Any]) -> None:
    """Every /v1 route needs ``Authorization: Bearer KEY`` and may answer 401."""
    schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    unauthorized = {
        "description": _WHEN[401],
        "headers": _HEADERS[401],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for path, operations in schema["paths"].items():
        if path.startswith("/v1/") or path in GUARDED_PATHS:
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]
                operation["responses"]["401"] = unauthorized
