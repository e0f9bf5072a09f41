"""Per-request sampling in transformers' continuous-batching engine, and what it cannot do.

transformers samples inside its engine, with one ``do_sample`` switch for every request
and per-request temperature, top-k and top-p (``per_request_processors``). So the engine
always samples, and a greedy request is top-k 1: the one token left is the argmax,
exactly what greedy decoding picks (ties between equal logits aside).

A per-request processor exists only if the engine's generation config gives it a value
that is not neutral when the engine starts (a temperature of 1.0 creates none), hence the
placeholders in ``ENGINE_SAMPLING``; every request then overrides all three.

Every other ``SamplingParams`` field that transformers cannot apply per request is
refused with a 400 naming it, never ignored (``unsupported``). Stop strings, stop token
ids, ``ignore_eos``, ``max_tokens`` and the detokenizer flags are llmctl's own work and
are honoured.
"""

from __future__ import annotations

from typing import Any

from llmctl.engine.sampling_params import SamplingParams

# The engine's generation config: placeholders that make transformers create the
# per-request temperature, top-k and top-p processors (never used as such).
ENGINE_SAMPLING = {"do_sample": True, "temperature": 0.5, "top_k": 1, "top_p": 0.5}

# Fields transformers' continuous batching cannot honour per request, with why.
CANNOT_HONOUR = {
    "min_p": "it has no per-request min-p",
    "repetition_penalty": "it has no per-request penalties",
    "presence_penalty": "it has no per-request penalties",
    "frequency_penalty": "it has no per-request penalties",
    "min_tokens": "it has no per-request minimum length",
    "seed": "it samples every request from one generator, seeded by the engine's seed option",
    "logprobs": (
        "it reports only the log-probability of the already filtered distribution "
        "(0 for every greedy token), not the model's"
    ),
    "top_logprobs": "it reports no alternative tokens",
    "logit_bias": "it has no per-request logit processors",
    "prompt_logprobs": (
        "its engine returns no logits for prompt positions (echo with logprobs, "
        "prompt_logprobs); serve with --backend torch or turbo"
    ),
    "structured": (
        "structured output (response_format, structured_outputs, tool_choice required or "
        "named) needs a per-request grammar mask, which its batched sampling has no place "
        "for; serve with --backend torch or turbo"
    ),
}
_NEUTRAL = SamplingParams()


def unsupported(sampling: SamplingParams) -> list[str]:
    """One sentence per field set to something transformers' engine cannot honour."""
    return [
        f"{name}={getattr(sampling, name)!r}: {why}"
        for name, why in CANNOT_HONOUR.items()
        if getattr(sampling, name) != getattr(_NEUTRAL, name)
    ]


def processor_kwargs(sampling: SamplingParams, vocab_size: int) -> dict[str, Any]:
    """The per-request temperature, top-k and top-p transformers applies to ``sampling``
    (the types are checked by transformers: floats and an int)."""
    if sampling.greedy:
        return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
    top_k = sampling.top_k if sampling.top_k > 0 else vocab_size  # <= 0: no top-k
    return {
        "temperature": float(sampling.temperature),
        "top_k": int(top_k),
        "top_p": float(sampling.top_p),
    }
