"""Request bodies of the OpenAI API, checked strictly, and their mapping to engine requests.

These models are the published contract: FastAPI turns them into the OpenAPI document,
with every field the server accepts and its bounds (the sampling ranges come from
``SamplingParams``' own table, so the document and the checks cannot drift apart).

Strict mode: ``"max_tokens": "5"`` or ``true`` is a type error, not a silent coercion
(``5.0`` is 5: JSON has one kind of number). ``null`` means "not set" for every
optional field. Unknown fields are refused by name,
as OpenAI's own API refuses them ("Unrecognized request argument"), so a client never
believes a field it sent (say ``logit_bias``) had an effect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from llmctl.engine.sampling_params import BOUNDS, SamplingParams
from llmctl.errors import InvalidRequest

MAX_N = 16  # choices per request: each one is a full engine request
MAX_CHOICES = 256  # prompts x n of one batched completion
MAX_STOP_STRINGS = 16  # each is searched for after every generated token
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# OpenAI's defaults: completions stop after 16 tokens; chat runs until the session is full
# (None: the engine fills in what is left of session_len).
DEFAULT_COMPLETION_TOKENS = 16


def _whole_number(value: Any) -> Any:
    """``5.0`` as ``5``: JSON (and JSON Schema's "integer") does not tell them apart."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _integer(*constraints: Any) -> Any:
    """``int`` with ``constraints``, taking ``5.0`` as 5 (the constraints come first, so
    pydantic publishes them as JSON Schema keywords)."""
    return Annotated[(int, *constraints, BeforeValidator(_whole_number))]


def _bounded(kind: type, name: str) -> Any:
    """``kind`` limited to ``SamplingParams``' range for ``name``."""
    if kind is int:
        return _integer(BOUNDS[name])
    return Annotated[kind, BOUNDS[name]]


TokenId = _integer(Field(ge=0))
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]],
        Field(min_length=1, max_length=MAX_CHOICES),
    ]
)


def _optional_fields_take_null(schema: dict[str, Any]) -> None:
    """Publish what ``_null_means_default`` accepts: null for every optional field."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        choices = prop.get("anyOf", [prop])
        if name not in required and not any(c.get("type") == "null" for c in choices):
            about = {
                key: prop.pop(key) for key in ("title", "description", "default") if key in prop
            }
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **about}


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        json_schema_extra=_optional_fields_take_null,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI accepts ``null`` for any optional field, and some clients send it. An
        unknown field stays, even as ``null``, to be refused by name."""
        if isinstance(data, dict):
            return {
                key: value
                for key, value in data.items()
                if value is not None or key not in cls.model_fields
            }
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM-style extras)."""

    model: str | None = Field(None, description="The served model's name (GET /v1/models).")
    max_tokens: _bounded(int, "max_tokens") | None = Field(
        None, description="Prompt tokens + max_tokens must fit in the model's session length."
    )
    temperature: _bounded(float, "temperature") = Field(1.0, description="Below 1e-5: greedy.")
    top_p: _bounded(float, "top_p") = 1.0
    n: _integer(Field(ge=1, le=MAX_N)) = Field(
        1, description="Choices; each is its own engine request."
    )
    stop: Stop | None = None
    seed: _bounded(int, "seed") | None = Field(None, description="Choice j uses seed + j.")
    presence_penalty: _bounded(float, "presence_penalty") = 0.0
    frequency_penalty: _bounded(float, "frequency_penalty") = 0.0
    user: str | None = Field(None, description="Accepted and unused.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Beyond OpenAI, as vLLM and lmdeploy accept them.
    top_k: _bounded(int, "top_k") = Field(0, description="0 or -1: off.")
    min_p: _bounded(float, "min_p") = 0.0
    repetition_penalty: _bounded(float, "repetition_penalty") = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: _bounded(int, "min_tokens") = Field(0, description="At most max_tokens.")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict:
        if self.stream_options is not None and not self.stream:  # as vLLM: never ignored
            raise InvalidRequest(
                "stream_options: only allowed with stream: true",
                param="stream_options",
                code="invalid_combination",
            )
        return dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_GenerationFields):
    """``POST /v1/completions``. ``logprobs`` is the legacy integer: how many alternatives."""

    prompt: Prompt = Field(
        description="A string, a list of strings, a list of token ids or a list of token-id "
        f"lists; prompts x n at most {MAX_CHOICES}."
    )
    logprobs: _bounded(int, "top_logprobs") | None = None

    def prompts(self) -> list[dict[str, Any]]:
        """One engine prompt per entry: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``.

        Raises ``InvalidRequest`` when the batch would start more than MAX_CHOICES
        engine requests.
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[dict[str, Any]] = [{"prompt": prompt}]
        elif isinstance(prompt[0], str):
            prompts = [{"prompt": text} for text in prompt]
        elif isinstance(prompt[0], int):
            prompts = [{"prompt_token_ids": list(prompt)}]
        else:
            prompts = [{"prompt_token_ids": list(ids)} for ids in prompt]
        if len(prompts) * self.n > MAX_CHOICES:
            raise InvalidRequest(
                f"prompt: {len(prompts)} prompts x n={self.n} would be "
                f"{len(prompts) * self.n} generations; at most {MAX_CHOICES} per request",
                param="prompt",
                code="invalid_combination",
            )
        return prompts

    def sampling_params(self) -> SamplingParams:
        """Raises ``InvalidRequest`` naming the field when values do not go together."""
        wanted = self.logprobs is not None
        max_tokens = DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens
        return SamplingParams(**self._sampling(max_tokens, wanted, self.logprobs or 0))


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A chat message. Extra keys (``name``, ...) are passed on to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_engine(self) -> dict[str, Any]:
        """The message as the engine's chat template wants it: content as plain text."""
        message = self.model_dump(exclude_none=True)
        if self.role == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(_GenerationFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _bounded(int, "max_tokens") | None = Field(
        None, description="Wins over max_tokens. Default: what is left of the session."
    )
    logprobs: bool = False
    top_logprobs: _bounded(int, "top_logprobs") | None = Field(
        None, description="Needs logprobs: true."
    )

    def sampling_params(self) -> SamplingParams:
        """Raises ``InvalidRequest`` naming the field when values do not go together."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest(
                "top_logprobs needs logprobs: true",
                param="top_logprobs",
                code="invalid_combination",
            )
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return SamplingParams(**self._sampling(max_tokens, self.logprobs, self.top_logprobs or 0))

    def engine_messages(self) -> list[dict[str, Any]]:
        return [message.for_engine() for message in self.messages]
