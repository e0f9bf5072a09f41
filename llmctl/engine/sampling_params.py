"""Per-request sampling parameters, shared by every engine, the server and the Python API.

Kept free of torch so the server and the CLI can build them without heavy imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from annotated_types import Interval

from llmctl.errors import InvalidRequest

# The range of every numeric parameter, declared once: SamplingParams checks values
# against it and the server publishes it in its OpenAPI schema (pydantic reads
# ``annotated_types`` constraints). An int bound reads "at least N" in messages.
BOUNDS: dict[str, Interval] = {
    "n": Interval(ge=1),
    "max_tokens": Interval(ge=1),
    "temperature": Interval(ge=0.0),
    "top_p": Interval(gt=0.0, le=1.0),
    "top_k": Interval(ge=-1),
    "min_p": Interval(ge=0.0, le=1.0),
    "repetition_penalty": Interval(gt=0.0),
    "presence_penalty": Interval(ge=-2.0, le=2.0),
    "frequency_penalty": Interval(ge=-2.0, le=2.0),
    # Within torch's seed range, and JSON-safe: JavaScript clients round beyond 2**53.
    "seed": Interval(ge=-(2**53 - 1), le=2**53 - 1),
    "min_tokens": Interval(ge=0),
    "top_logprobs": Interval(ge=0, le=20),
    "prompt_logprobs": Interval(ge=0, le=20),
}

# logit_bias values, as OpenAI bounds them.
LOGIT_BIAS_BOUNDS = Interval(ge=-100.0, le=100.0)

# What a grammar constrains the output to; the value's meaning depends on the kind.
GRAMMAR_KINDS = ("json", "json_schema", "regex", "choice", "ebnf", "lark", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output must follow (the engine compiles it with xgrammar).

    ``kind`` is one of ``GRAMMAR_KINDS``: ``json`` (any JSON object, ``value`` empty),
    ``json_schema`` (``value``: the schema as JSON text), ``regex`` (the pattern),
    ``choice`` (``value``: a JSON list of the allowed strings), ``ebnf`` (a GBNF/EBNF
    grammar whose start rule is ``root``), ``lark`` (a Lark grammar whose start rule is
    ``start``) or ``structural_tag`` (xgrammar's structural tag as JSON: tool calls in a
    model family's format, their arguments by schema). Frozen and hashable: compiled
    grammars are cached by it.
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(
                f"unknown grammar kind {self.kind!r}; one of {', '.join(GRAMMAR_KINDS)}"
            )


# Below this a temperature is greedy: dividing logits by a tinier number overflows
# float32 and turns the distribution into NaN (vLLM draws the line at the same place).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` under 1e-5 (0 included) means greedy. ``top_k <= 0`` disables
    top-k. ``max_tokens=None`` means "until the session is full" (OpenAI's chat
    default); the engine fills it in. ``n`` choices per prompt run as ``n`` engine
    requests (``choices()``); the engine itself sees one each. Every value is checked in ``__post_init__``; a bad
    one raises ``InvalidRequest`` naming the field in ``param``.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: StructuredOutput | None = None
    # The logprob of each prompt token given the ones before it, with this many most
    # likely alternatives (vLLM's prompt_logprobs; ``echo`` with logprobs); None: not asked.
    prompt_logprobs: int | None = None
    # Choices per prompt (last, so the fields before keep their positions).
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, bounds in BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not _within(value, bounds):
                raise InvalidRequest(
                    f"{name} must be {describe(bounds)}, got {value}",
                    param=name,
                    code="invalid_value",
                )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
                code="invalid_combination",
            )
        if not all(self.stop):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must not be negative", param="stop_token_ids")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0 or not _within(bias, LOGIT_BIAS_BOUNDS):
                raise InvalidRequest(
                    f"logit_bias maps token ids (at least 0) to values "
                    f"{describe(LOGIT_BIAS_BOUNDS)}, got {token_id}: {bias}",
                    param="logit_bias",
                    code="invalid_value",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def choices(self) -> list[SamplingParams]:
        """The ``n`` single-choice params one prompt runs as. Choice ``j`` of a seeded
        request uses seed + j, so the choices differ yet the whole result reproduces.
        With ``n == 1`` the params themselves: nothing mutates them once made, and a copy
        per request cost ``LLM.generate`` about 5 µs a prompt."""
        if self.n == 1:
            return [self]
        return [
            replace(self, n=1, seed=None if self.seed is None else self.seed + j)
            for j in range(self.n)
        ]


def _within(value: Any, bounds: Interval) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (
        (bounds.gt is None or value > bounds.gt)
        and (bounds.ge is None or value >= bounds.ge)
        and (bounds.lt is None or value < bounds.lt)
        and (bounds.le is None or value <= bounds.le)
    )


def describe(bounds: Interval) -> str:
    """``in (0, 1]``, ``>= 0``, ``> 0`` or, for an integer lower bound, ``at least 1``."""
    low = bounds.gt if bounds.gt is not None else bounds.ge
    high = bounds.lt if bounds.lt is not None else bounds.le
    if high is not None:
        opening = "(" if bounds.gt is not None else "["
        closing = ")" if bounds.lt is not None else "]"
        return f"in {opening}{_number(low)}, {_number(high)}{closing}"
    if bounds.gt is not None:
        return f"> {_number(low)}"
    return f"at least {low}" if isinstance(low, int) else f">= {_number(low)}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
