"""One request as the engine tracks it: its tokens, its KV blocks and where it stands.

Also the rules every local engine applies to a request, whatever runs its model: what it
refuses before starting (``validate_request``) and when a generated token ends it
(``finish_reason``). Shared (the transformers plugin uses them too) so that limits, stop
strings and stop tokens behave the same on every backend."""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, Any

from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

    from llmctl.engine.detokenizer import IncrementalDetokenizer
    from llmctl.engine.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's token stream and bookkeeping.

    ``token_ids`` is prompt + generated tokens. ``num_computed_tokens`` of them have
    their K/V in the cache; the rest are fed to the model by the next steps (a prefill
    chunk, or the one token sampled last). ``block_table[i]`` is the physical block
    holding tokens ``i * block_size .. (i + 1) * block_size - 1``. ``block_hashes`` are
    the prefix-cache keys of the leading full, computed blocks.

    When steps overlap (GPU), a token can be sampled but not yet on the host:
    ``num_pending_tokens`` counts it. It is a token of the step in flight, and the next
    step reads it there (``scheduler.StepBatchBuilder``).
    ``stop_token_ids`` are the ids that end the request (its own, and EOS unless
    ``ignore_eos``).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "num_prompt_tokens",
        "max_tokens",
        "token_ids",
        "sampling",
        "status",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "finish_reason",
        "detokenizer",
        "generator",
        "stop_token_ids",
        "plain_greedy",
        "row",
        "num_pending_tokens",
        "grammar",
        "num_cached_tokens",
        "proposal",
        "speculation",
        "draft_computed",
        "prompt_logprobs",
        "lora",
        "lora_slot",
        "cache_salt",
        "stream_interval",
        "unsent_texts",
        "unsent_logprobs",
        "hold_below",
        "num_held_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        detokenizer: IncrementalDetokenizer | None = None,
        eos_token_ids: tuple[int, ...] = (),
        grammar: GrammarState | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling = sampling
        # Copies the step loop reads without touching the prompt list or the params.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_tokens = sampling.max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        # A seeded request's own random stream, created by the sampler on first use.
        self.generator: torch.Generator | None = None
        self.stop_token_ids = stop_token_ids(sampling, eos_token_ids)
        # Greedy with nothing that needs the logits on the host's terms: one argmax.
        self.plain_greedy = sampling.greedy and not (
            sampling.repetition_penalty != 1.0
            or sampling.frequency_penalty
            or sampling.presence_penalty
            or sampling.min_tokens
            or sampling.logprobs
            or sampling.top_logprobs
            or sampling.logit_bias
            or grammar is not None
        )
        self.row: int | None = None  # its row in the step inputs while it runs
        self.num_pending_tokens = 0
        # The matcher of a request with structured output: it has seen every output token.
        self.grammar = grammar
        # Prompt tokens the prefix cache held at first admission (None until admitted).
        self.num_cached_tokens: int | None = None
        # Speculative decoding: the tokens proposed for the next step (fed after the last
        # token and verified by it), and the request's counts (llmctl.engine.speculative).
        self.proposal: list[int] = []
        self.speculation: Any = None
        # Tokens whose K/V the draft model holds (speculative_method=draft): never more
        # than num_computed_tokens counts (llmctl.engine.draft).
        self.draft_computed = 0
        # Asked for prompt logprobs: one TokenLogprob per prompt token scored so far (the
        # engine puts the first token's in at admission, later ones come from the logits).
        self.prompt_logprobs: list[Any] | None = None
        # Its LoRA adapter (llmctl.engine.lora; None: the base model), the adapter's slot
        # while it runs (-1: none), and the start of its prefix-cache keys (per adapter).
        self.lora: Any = None
        self.lora_slot = -1
        self.cache_salt = b""
        # Outputs go out at the first token, every stream_interval-th and the last; the
        # tokens between wait here, one text (maybe "") per token, and their logprobs.
        self.stream_interval = 1
        self.unsent_texts: list[str] = []
        self.unsent_logprobs: list[Any] = []
        # The engine's short path for such held tokens (``LLMEngine._process``): while
        # it has fewer tokens than ``hold_below`` (no output due, max_tokens not near), a
        # new token that is no stop id and whose text is its table entry is only counted
        # in ``num_held_tokens``; its text is read from the table when it goes out
        # (``release_held``). The full checks set ``hold_below`` after a token, for
        # requests without grammar or logprobs whose text is plain; 0: never held.
        self.hold_below = 0
        self.num_held_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether some prompt tokens still wait for their logprobs: the steps feeding
        its prompt return logits at every position, and no prefix comes from the cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling reads its previous tokens (penalties, a grammar's mask): no
        step may then be prepared before the last one's tokens reached the host."""
        params = self.sampling
        return bool(
            params.repetition_penalty != 1.0
            or params.frequency_penalty
            or params.presence_penalty
            or self.grammar is not None
        )

    def release_held(self) -> None:
        """Put the texts of the newest ``num_held_tokens`` tokens into ``unsent_texts``:
        their table entries, the text was plain while they were held."""
        texts = self.detokenizer.plain_texts
        held = self.token_ids[len(self.token_ids) - self.num_held_tokens :]
        self.unsent_texts.extend([texts[token_id] for token_id in held])
        self.num_held_tokens = 0

    def take_unsent(
        self, text: str, num_new: int, logprobs: list[Any] | None
    ) -> tuple[str, list[int], list[Any] | None]:
        """One output's text, token ids and logprobs: the tokens a stream_interval held
        back, then the ``num_new`` newest (``text``, ``logprobs``: theirs). Nothing is
        held back afterwards."""
        unsent = self.unsent_texts
        token_ids = self.token_ids[len(self.token_ids) - len(unsent) - num_new :]
        if self.unsent_logprobs:
            logprobs = self.unsent_logprobs + (logprobs or [])
        text = "".join(unsent) + text
        self.unsent_texts, self.unsent_logprobs = [], []
        return text, token_ids, logprobs

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )


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
    eos = () if sampling.ignore_eos else tuple(eos_token_ids)
    return _shared_stop_ids(tuple(sampling.stop_token_ids), eos)


@functools.lru_cache(maxsize=256)
def _shared_stop_ids(own: tuple[int, ...], eos: tuple[int, ...]) -> frozenset[int]:
    # Requests asking the same share one set: the engine looks each step's new tokens up
    # in it right after the model call, when one set is in the cache and many are not.
    return frozenset(own + eos)


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
