"""Request bodies of the OpenAI API, checked strictly, and their mapping to engine requests.

Strict mode: ``"max_tokens": "5"`` or ``true`` is a type error, not a silent coercion.
Unknown fields are refused by name, so a client never believes a field it sent (say
``logit_bias``) had an effect. Value ranges are checked once, by ``SamplingParams``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmctl.engine.sampling_params import SamplingParams

MAX_N = 16  # choices per request: each one is a full engine request
MAX_CHOICES = 256  # prompts x n of one batched completion
# OpenAI's defaults: completions stop after 16 tokens; chat runs until the session is full
# (None: the engine fills in what is left of session_len).
DEFAULT_COMPLETION_TOKENS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI accepts ``null`` for any optional field, and some clients send it."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM-style extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Beyond OpenAI, as vLLM and lmdeploy accept them.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict:
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

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)

    def prompts(self) -> list[dict[str, Any]]:
        """One engine prompt per entry: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], str):
            return [{"prompt": text} for text in prompt]
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": list(prompt)}]
        if not all(prompt):
            raise ValueError("prompt: each list of token ids must hold at least one id")
        return [{"prompt_token_ids": list(ids)} for ids in prompt]

    def checked_prompts(self) -> list[dict[str, Any]]:
        """``prompts()``, refusing a batch that would start too many engine requests."""
        prompts = self.prompts()
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"prompt: {len(prompts)} prompts x n={self.n} would be "
                f"{len(prompts) * self.n} generations; at most {MAX_CHOICES} per request"
            )
        return prompts

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
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
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return SamplingParams(**self._sampling(max_tokens, self.logprobs, self.top_logprobs or 0))

    def engine_messages(self) -> list[dict[str, Any]]:
        return [message.for_engine() for message in self.messages]
