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

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from llmctl.engine.sampling_params import (
    BOUNDS,
    LOGIT_BIAS_BOUNDS,
    SamplingParams,
    StructuredOutput,
)
from llmctl.errors import InvalidRequest
from llmctl.server.protocol_base import Strict
from llmctl.server.structured_output import ResponseFormat, StructuredOutputs
from llmctl.server.tools import (
    MAX_TOOLS,
    NamedToolChoice,
    Tool,
    ToolChoice,
    call_grammar,
    forced_tools,
    template_tools,
)

MAX_N = 16  # choices per request: each one is a full engine request
MAX_CHOICES = 256  # prompts x n of one batched completion
MAX_STOP_STRINGS = 16  # each is searched for after every generated token
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
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


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False,
        description="vLLM's: with include_usage, every chunk carries the usage so far "
        "(a client stopped mid-stream still knows its token count).",
    )


class _GenerationFields(Strict):
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
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")],
                Annotated[float, LOGIT_BIAS_BOUNDS],
            ],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = Field(None, description="Token id (as a string) -> a value added to its logit.")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema: the output follows it exactly."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: one of json (a schema), regex, choice, grammar, json_object."
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def structured_spec(self) -> StructuredOutput | None:
        """The grammar the output must follow (``None``: free text)."""
        if self.response_format is not None and self.structured_outputs is not None:
            if self.response_format.type != "text":
                raise InvalidRequest(
                    "give response_format or structured_outputs, not both",
                    param="structured_outputs",
                    code="invalid_combination",
                )
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        if self.response_format is not None:
            return self.response_format.spec()
        return None

    @property
    def structured_param(self) -> str:
        """The field a grammar came from, for the ``param`` of its compile error."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

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
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            structured=self.structured_spec(),
        )


class CompletionRequest(_GenerationFields):
    """``POST /v1/completions``. ``logprobs`` is the legacy integer: how many alternatives."""

    prompt: Prompt = Field(
        description="A string, a list of strings, a list of token ids or a list of token-id "
        f"lists; prompts x n at most {MAX_CHOICES}."
    )
    logprobs: _bounded(int, "top_logprobs") | None = None
    echo: bool = Field(
        False,
        description="Start each choice's text with its prompt; with logprobs, the prompt's "
        "tokens lead the logprobs too (the first one's logprob null).",
    )
    prompt_logprobs: _bounded(int, "prompt_logprobs") | None = Field(
        None,
        description="vLLM's: each choice gets prompt_logprobs, one entry per prompt token "
        "(null for the first): its logprob given the tokens before it, with this many "
        "most likely alternatives, keyed by token id.",
    )

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
        scored = [self.prompt_logprobs, self.logprobs if self.echo else None]
        scored = [k for k in scored if k is not None]
        max_tokens = DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens
        return SamplingParams(
            **self._sampling(max_tokens, wanted, self.logprobs or 0),
            prompt_logprobs=max(scored) if scored else None,
        )


class TextPart(Strict):
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
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_template_call(call) for call in calls]
        return message


def _template_call(call: Any) -> Any:
    """An assistant's tool call as templates read it: OpenAI sends the arguments as JSON
    text, Hugging Face templates expect them as a mapping (they write ``| tojson``)."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            raise InvalidRequest(
                f"the arguments of tool call {call.get('id')!r} are not JSON: "
                f"{function['arguments'][:80]!r}",
                param="messages",
            ) from None
        return {**call, "function": {**function, "arguments": arguments}}
    return call


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
    prompt_logprobs: _bounded(int, "prompt_logprobs") | None = Field(
        None,
        description="vLLM's: the response gets prompt_logprobs, one entry per token of the "
        "rendered prompt (null for the first), with this many alternatives; not with stream.",
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Functions the model may call; the chat template receives them."
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="none, auto (the default with tools), required, or a named function; "
        "required and named are enforced by a grammar.",
    )
    parallel_tool_calls: bool = Field(True, description="Allow more than one call.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (enable_thinking, ...)."
    )

    @property
    def tool_choice_value(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def check_tools(self) -> None:
        """Refuse tool fields that do not go together."""
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise InvalidRequest(
                "tool_choice needs tools: give the functions the model may call",
                param="tool_choice",
                code="invalid_combination",
            )
        if self.tools and self.n > 1:
            raise InvalidRequest(
                "tools take n = 1: each choice's calls would need ids of their own, which "
                "this server does not give yet; send one request per choice",
                param="n",
                code="invalid_combination",
            )
        if self.forced_tools() and self.structured_spec() is not None:
            raise InvalidRequest(
                "tool_choice required or named sets the output's grammar itself; drop "
                "response_format / structured_outputs",
                param="tool_choice",
                code="invalid_combination",
            )
        reserved = {"messages", "tools", "add_generation_prompt"} & set(
            self.chat_template_kwargs or {}
        )
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs must not set {', '.join(sorted(reserved))}: the "
                "server passes those itself",
                param="chat_template_kwargs",
                code="invalid_combination",
            )

    def forced_tools(self) -> list[Tool]:
        return forced_tools(self.tools or [], self.tool_choice_value)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as ``tools`` (with tool_choice none too, as vLLM:
        the conversation may still refer to them)."""
        return template_tools(self.tools) if self.tools else None

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is read for tool calls."""
        return bool(self.tools) and self.tool_choice_value != "none"

    @property
    def structured_param(self) -> str:
        if self.forced_tools():
            return "tool_choice" if isinstance(self.tool_choice, NamedToolChoice) else "tools"
        return super().structured_param

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
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            raise InvalidRequest(
                "prompt_logprobs is not available with stream: true",
                param="prompt_logprobs",
                code="invalid_combination",
            )
        self.check_tools()
        fields = self._sampling(max_tokens, self.logprobs, self.top_logprobs or 0)
        return SamplingParams(**fields, prompt_logprobs=self.prompt_logprobs)

    def tool_sampling(self, sampling: SamplingParams, family: str) -> SamplingParams:
        """``sampling`` with the grammar of a forced call in ``family``'s format, and the
        special tokens kept when the family marks calls with one ([TOOL_CALLS])."""
        forced = self.forced_tools()
        if forced:
            grammar = call_grammar(forced, family, self.parallel_tool_calls)
            sampling = dataclasses.replace(sampling, structured=grammar)
        if self.calls_tools and family == "mistral":
            sampling = dataclasses.replace(sampling, skip_special_tokens=False)
        return sampling

    def engine_messages(self) -> list[dict[str, Any]]:
        return [message.for_engine() for message in self.messages]
