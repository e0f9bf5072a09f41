"""The rules every local engine applies to a request, whatever runs its model: what it
refuses before starting (``validate_request``) and when a generated token ends it
(``finish_reason``). Shared so that limits, stop strings and stop tokens behave the same
on every backend."""

from __future__ import annotations

from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import InvalidRequest


def validate_request(
    prompt_token_ids: list[int],
    sampling: SamplingParams,
    *,
    vocab_size: int | None,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """Raise ``InvalidRequest`` if this request can never run on an engine of this size."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty: give at least one token")
    if vocab_size is not None:
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})"
            )
        biased = [t for t in sampling.logit_bias if t >= vocab_size]
        if biased:
            raise InvalidRequest(
                f"logit_bias token ids {biased[:5]} are outside the vocabulary "
                f"(0..{vocab_size - 1})",
                param="logit_bias",
            )
    prompt_len, limit = len(prompt_token_ids), max_model_len
    if sampling.max_tokens is None and prompt_len >= limit:
        raise InvalidRequest(
            f"the prompt ({prompt_len} tokens) leaves no room to generate within "
            f"session_len {limit}: shorten the prompt",
            code="context_length_exceeded",
        )
    total = prompt_len + (
        limit - prompt_len if sampling.max_tokens is None else sampling.max_tokens
    )
    if total > limit:
        allowed = f"at most {limit - prompt_len}" if prompt_len < limit else "none"
        raise InvalidRequest(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({sampling.max_tokens}) "
            f"is {total} tokens, more than session_len {limit}: shorten the prompt or "
            f"lower max_tokens ({allowed} fit)",
            code="context_length_exceeded",
        )
    needed = -(-total // block_size)
    if needed > num_blocks:
        raise InvalidRequest(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({sampling.max_tokens}) "
            f"needs {needed} KV blocks of {block_size} tokens, but the whole "
            f"cache has {num_blocks}: lower max_tokens or give the engine "
            "a larger cache_max_entry_count",
            code="context_length_exceeded",
        )


def stop_token_ids(sampling: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The ids that end a request: its own stop ids, and EOS unless ``ignore_eos``."""
    stops = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stops.update(eos_token_ids)
    return frozenset(stops)


def finish_reason(
    token_id: int,
    num_output_tokens: int,
    sampling: SamplingParams,
    stop_ids: frozenset[int],
    detokenizer: IncrementalDetokenizer,
) -> str | None:
    """Feed a request's newest token (its ``num_output_tokens``-th) to its detokenizer and
    say whether it ends the request: ``"stop"`` (a stop id from ``stop_token_ids``, or a
    stop string), ``"length"`` (max_tokens reached) or ``None``.

    A stopping token's text is left out unless ``include_stop_str_in_output``.
    """
    reason = "stop" if token_id in stop_ids else None
    if reason is None or sampling.include_stop_str_in_output:
        detokenizer.add_token(token_id)
    if reason is None:
        if detokenizer.stopped:
            reason = "stop"
        elif num_output_tokens >= sampling.max_tokens:
            reason = "length"
    return reason
