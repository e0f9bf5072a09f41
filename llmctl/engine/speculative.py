"""Speculative decoding: propose a few tokens cheaply, verify them all in one model step.

A decoding sequence normally feeds one token per step. With ``speculative_method=ngram``
the engine first looks for its last few tokens earlier in its own text (prompt lookup,
``propose_ngram``) and feeds the tokens that followed there as well (with
``speculative_method=draft`` a small model writes them: ``llmctl.engine.draft``): the step then
computes the target model's logits at every one of those k + 1 positions (the runner's
``logits_indices``), and ``verify`` keeps the longest run of proposals the model agrees
with, plus one token of its own (the "bonus": the model's token after the last accepted
one, or in place of the first rejected one). The K/V of rejected positions are rolled
back (``Scheduler.rollback``).

Verification keeps the output exactly what plain decoding gives:

- greedy: a proposal is accepted while it is the model's argmax (after penalties), so the
  tokens are those of one-at-a-time greedy decoding;
- sampling: the proposal distribution of prompt lookup is a point mass on token t, so
  (Leviathan et al., Chen et al.) t is accepted with probability p(t), p the request's
  distribution at that position after penalties, min_tokens, temperature, top-k, top-p
  and min-p, exactly as the sampler builds it with the accepted tokens as history;
  otherwise the token is drawn from the residual max(p - q, 0) normalized, which is p
  without t. Every token is then distributed as p. A seeded request draws from its own
  generator.

Adaptive, per request and per step (``Speculator.num_proposals``): a proposal is worth its
cost when the chance it is accepted beats what its place in the step costs. Each request
keeps a decayed count of its accepted proposals and of its rejections, so ``p``, the chance
that a proposal is accepted after the one before it was, is known as it goes; the j-th
proposal of a step is then accepted with chance ``p**j``. A proposal adds ``b`` seconds to
a step and a verification ``c`` besides (``StepCost``, fitted from the decoding steps the
engine runs); the j-th pays if ``p**j`` exceeds ``b`` times the engine's tokens per
second, and the k that pay must make up for ``c`` too. A request starts with one
proposal; one whose proposals do not pay pauses (proposes nothing) for a few steps, then
probes with one token again, only where its text's last ``ngram_max`` tokens occur earlier
(a repeat that long is what copying looks like), the pause doubling while that does not
pay. So a request that copies its prompt proposes up to ``num_speculative_tokens``
tokens, prompts that do not repeat lose almost nothing, and a large batch, whose steps
grow with every token, speculates only where proposals are nearly always accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from llmctl.engine.config import SpeculativeConfig
from llmctl.engine.draft import DraftModel
from llmctl.engine.sampler import (
    SampledToken,
    Sampler,
    apply_penalties,
    apply_truncation,
    argmax_rows,
    exponential_noise,
    mask_stops_before_min_tokens,
)
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.scheduler import ScheduledStep
from llmctl.engine.sequence import Sequence
from llmctl.engine.step_profile import SpeculationStats

# Weight of the newest step in the fit of a step's time to its tokens (``StepCost``).
STEP_TIME_WEIGHT = 0.05
# What a request's acceptance counts start from (a proposal as likely accepted as not), and
# how much each verification step keeps of the counts before it: about the last ten steps
# decide, so a request that stops copying its prompt soon proposes less.
PRIOR_ACCEPTED = PRIOR_REJECTED = 0.5
ACCEPTANCE_DECAY = 0.9
# The longest pause (steps without proposals) of a request whose proposals do not pay.
MAX_PAUSE_STEPS = 32


class StepCost:
    """A step's time as ``a + b * tokens + c * verifies`` (its new tokens; whether it
    verifies proposals), fitted as the engine runs: exponentially weighted least squares
    over the steps that only decode or verify, with their drafting. ``a`` is what a step
    costs whatever it feeds (the weights read once, the per-step overheads), ``b`` what
    each token adds (its logits included), ``c`` what verifying adds besides (a draft
    model's steps, the acceptance on the host). A step with a prompt chunk stays out of
    the fit: its tokens have no logits (SmolLM2's LM head is a fifth of a token's
    work), and one prefill of thousands of tokens set the slope for the next hundred
    steps, leaving the logits of verified positions to ``c``: 6-14 ms a step at batch 16,
    against 0.4-0.6 ms fitted on decoding steps alone. Every step counts in the engine's
    rate, tokens emitted per second, over the same window."""

    def __init__(self) -> None:
        # Exponentially weighted sums over the steps of 1, t, v, s and of the products the
        # fit needs (t: tokens, v: verifies, 0 or 1, s: seconds), as plain floats: numpy's
        # calls on arrays this small cost 100-200 µs a step beside a running model.
        self._sums = [0.0] * 9  # 1, t, v, s, tt, tv, ts, vv, vs
        self._emitted = self._seconds = 0.0
        self.fit: tuple[float, float, float] | None = None  # (a, b, c); None until known

    def add(
        self, tokens: int, seconds: float, emitted: int, verifies: bool, decodes: bool = True
    ) -> None:
        """Note a step; ``decodes``: it only decodes or verifies (no prompt chunk)."""
        keep = 1.0 - STEP_TIME_WEIGHT
        self._emitted = keep * self._emitted + emitted
        self._seconds = keep * self._seconds + seconds
        if not decodes:
            return
        t, v, s = float(tokens), float(verifies), seconds
        terms = (1.0, t, v, s, t * t, t * v, t * s, v * v, v * s)
        self._sums = [keep * total + term for total, term in zip(self._sums, terms)]
        self.fit = self._solve()

    @property
    def rate(self) -> float:
        """Tokens emitted per second of step time."""
        return self._emitted / self._seconds if self._seconds > 0.0 else 0.0

    def _solve(self) -> tuple[float, float, float] | None:
        """``(a, b, c)``; ``None`` until steps of different sizes have been measured. ``c``
        is 0 while every step verifies, or none does (it cannot be told from ``a``)."""
        weight, t, v, s, tt, tv, ts, vv, vs = self._sums
        if weight < 2:
            return None
        mean_t, mean_v, mean_s = t / weight, v / weight, s / weight
        var_t = tt / weight - mean_t * mean_t  # the weighted (co)variances
        if var_t < 1e-6:
            return None
        cov_tv, cov_ts = tv / weight - mean_t * mean_v, ts / weight - mean_t * mean_s
        var_v, cov_vs = vv / weight - mean_v * mean_v, vs / weight - mean_v * mean_s
        b, c = cov_ts / var_t, 0.0
        if var_v > 1e-3:  # least squares on (t, v): the 2 x 2 normal equations
            det = var_t * var_v - cov_tv * cov_tv
            if det > 1e-9 * var_t:
                b = (cov_ts * var_v - cov_tv * cov_vs) / det
                c = (var_t * cov_vs - cov_tv * cov_ts) / det
        b, c = max(b, 0.0), max(c, 0.0)
        return mean_s - b * mean_t - c * mean_v, b, c


def propose_ngram(
    token_ids: list[int] | np.ndarray, ngram_min: int, ngram_max: int, num_tokens: int
) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the text's
    last n tokens (the longest n from ``ngram_max`` down to ``ngram_min`` that occurs),
    at most ``num_tokens`` of them; ``[]`` when no suffix occurs earlier.

    Vectorised over the candidates (the earlier places of the last token, each followed
    by at least one token): their match length grows one token back at a time, so a
    lookup costs ``ngram_max`` numpy operations whatever the text's length."""
    tokens = np.asarray(token_ids)
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # where a match would end
    if not len(ends):
        return []
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, ngram_max):
        before = ends - back
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[last - back]
        if not alive.any():
            break
        lengths += alive
    longest = int(lengths.max())
    if longest < ngram_min:
        return []
    start = int(ends[np.flatnonzero(lengths == longest)[-1]]) + 1
    return tokens[start : start + num_tokens].tolist()


@dataclass
class SpecState:
    """One request's speculation: its decayed acceptance counts (``p``, the chance a
    proposal is accepted after the one before it was, is ``hits / (hits + misses)``), and
    its pause: steps left without proposals, and the next pause's length."""

    hits: float = PRIOR_ACCEPTED
    misses: float = PRIOR_REJECTED
    paused: int = 0
    next_pause: int = 1
    stopped: bool = False  # paused at least once (counted in ``stopped_requests``)
    # Until its next verification the request proposes one token (at its start, and after
    # each pause); after a pause, only where its text's longest suffix looked up
    # (ngram_max tokens) occurs earlier. A repeat that long is what copying looks like, so
    # a prompt with nothing to repeat costs almost no verification at all.
    probing: bool = True
    # The text's windows of ``ngram_max`` tokens, each to the end of its latest place: kept
    # as the text grows (``latest_repeat``), so that check, and a proposal wherever the
    # text's last ngram_max tokens repeat (copying), cost a look-up, not a search of the
    # whole text each step (propose_ngram: ~0.45 ms at 16 k tokens).
    windows: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # the next window end to put in ``windows``

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.hits = self.hits * ACCEPTANCE_DECAY + num_accepted
        self.misses = self.misses * ACCEPTANCE_DECAY + (num_accepted < num_proposed)

    def latest_repeat(self, token_ids: list[int], n: int) -> int | None:
        """Where the tokens after the latest earlier occurrence of the text's last ``n``
        tokens start; ``None`` if they occur nowhere earlier. ``n`` is the same at every
        call, and the text only grows (rejected proposals never enter it)."""
        last = len(token_ids)
        windows = self.windows
        for end in range(max(self.indexed, n), last):  # the windows before the last one
            windows[tuple(token_ids[end - n : end])] = end
        self.indexed = max(self.indexed, last)
        return windows.get(tuple(token_ids[last - n :])) if last > n else None


class Speculator:
    """Proposes tokens for decoding sequences and verifies them after the model step.
    With a ``draft`` model (``speculative_method=draft``) the proposals are placeholders
    until the step is scheduled: ``fill_proposals`` has the draft write them into the
    blocks the scheduler allocated."""

    def __init__(
        self, config: SpeculativeConfig, sampler: Sampler, draft: DraftModel | None = None
    ) -> None:
        self.config = config
        self.sampler = sampler
        self.draft = draft
        self.stats = SpeculationStats()
        self.cost = StepCost()
        self._verifying = 1.0  # requests that verify in a verification step, on average

    def step_seconds(
        self, tokens: int, seconds: float, emitted: int, verifying: int, decodes: bool = True
    ) -> None:
        """Note how long a step of ``tokens`` new tokens took (with its drafting), how many
        tokens it gave its requests, how many of its requests verified proposals, and
        whether it only decoded or verified (``StepCost.add``)."""
        self.cost.add(tokens, seconds, emitted, verifying > 0, decodes)
        if verifying:
            self._verifying += STEP_TIME_WEIGHT * (verifying - self._verifying)

    def num_proposals(self, state: SpecState) -> int:
        """How many tokens a request proposes this step (at most ``num_speculative_tokens``).
        The j-th adds ``b`` seconds (``StepCost``) and ``p**j`` tokens (``p``:
        ``SpecState.acceptance``): it pays while ``p**j`` exceeds ``b`` times the engine's
        tokens per second, and the k that pay must also make up for ``c``, what verifying
        costs besides. At batch 1 on a memory-bound model a token costs little and nearly
        any acceptance pays; in a large batch whose step is compute-bound only
        near-certain proposals do. Until the cost is known a request proposes one token;
        one whose proposals do not pay pauses (module docstring)."""
        if state.paused:
            state.paused -= 1
            state.probing = not state.paused  # a pause ends with a probe, to measure again
            return 0
        fit = self.cost.fit
        if state.probing or fit is None:
            return 1  # a cheap measure (also while the fit has not seen two step sizes)
        _, b, c = fit
        c /= max(self._verifying, 1.0)  # the requests that verify together share it
        rate = self.cost.rate
        p = state.acceptance
        bar = b * rate  # the chance of acceptance above which one more token pays
        count = self.config.num_tokens
        # p reaches 1.0 in floating point after a few hundred steps with nothing rejected
        # (a draft that is the model itself): then every proposal pays.
        if bar > 0.0 and p < 1.0:
            count = min(count, int(math.log(bar) / math.log(p))) if p > bar else 0
        if count and sum(p**j for j in range(1, count + 1)) > rate * (c + b * count):
            state.next_pause = 1
            return count
        state.paused = state.next_pause
        state.next_pause = min(2 * state.next_pause, MAX_PAUSE_STEPS)
        if not state.stopped:
            state.stopped = True
            self.stats.stopped_requests += 1
        return 0

    def propose(self, seqs: list[Sequence]) -> bool:
        """Set ``seq.proposal`` for every running sequence; whether any got tokens.

        Only a sequence without a grammar that decodes (all its tokens but the last computed, none still
        on the device) proposes, and never more tokens than its max_tokens leaves room
        for beside the bonus token."""
        config = self.config
        any_proposed = False
        for seq in seqs:
            seq.proposal = []
            if seq.grammar is not None:
                continue  # its mask follows one token at a time: verified tokens would skip it
            state = seq.speculation
            if state is None:
                state = seq.speculation = SpecState()
            if seq.num_pending_tokens or seq.num_computed_tokens != len(seq.token_ids) - 1:
                continue  # a token still on the device, or still prefilling
            room = min(
                self.num_proposals(state), seq.sampling.max_tokens - seq.num_output_tokens - 1
            )
            if room <= 0:
                continue
            if self.draft is not None:  # room for the draft's tokens (fill_proposals)
                proposal = [seq.token_ids[-1]] * room
            elif (start := state.latest_repeat(seq.token_ids, config.ngram_max)) is not None:
                # The longest match prompt lookup allows: propose_ngram's answer, unsearched.
                proposal = seq.token_ids[start : start + room]
            elif state.probing and state.stopped:  # only a repeat of ngram_max tokens probes
                continue
            else:
                proposal = propose_ngram(seq.token_ids, config.ngram_min, config.ngram_max, room)
            if proposal:
                seq.proposal = proposal
                any_proposed = True
        return any_proposed

    def fill_proposals(self, step: ScheduledStep) -> None:
        """A draft model's tokens in place of the placeholders of the step's proposing
        rows, as many as the scheduler kept for each (in the proposals and the step's
        input ids: each row feeds its last token, then its proposals)."""
        if self.draft is None or not step.proposed:
            return
        rows = list(step.proposed)
        self.draft.fill([step.seqs[i] for i in rows], [step.proposed[i] for i in rows])
        starts = np.cumsum([0, *step.num_new_tokens])
        for i in rows:
            proposal = step.proposed[i]
            first = int(starts[i]) + 1
            step.input_ids[first : first + len(proposal)] = proposal

    def verify(
        self,
        seq: Sequence,
        proposal: list[int],
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None = None,
    ) -> tuple[list[int], list[SampledToken | None]]:
        """The tokens ``seq`` gets from one verification step (the accepted proposals and
        the bonus token) and, if it asked, their logprobs. ``logits`` are the model's
        ``[len(proposal) + 1, vocab]`` at the positions of the step's last token and each
        proposal; ``greedy_ids`` their argmax, when the runner found it with the logits."""
        if seq.plain_greedy:  # no penalties, no logprobs: the argmax of the raw logits
            if greedy_ids is None:
                greedy_ids = argmax_rows(logits)
            tokens = _accept_greedy(proposal, greedy_ids.tolist())
            logprobs: list[SampledToken | None] = [None] * len(tokens)
        else:
            tokens, logprobs = self._verify_processed(seq, proposal, logits)
        self._record(seq, len(proposal), len(tokens) - 1)
        return tokens, logprobs

    def _verify_processed(
        self, seq: Sequence, proposal: list[int], logits: torch.Tensor
    ) -> tuple[list[int], list[SampledToken | None]]:
        """Verification through the sampler's processing, position by position (each
        position's history holds the proposals before it, as if they were accepted)."""
        sampling = seq.sampling
        views = [_Position(seq, proposal[:j]) for j in range(len(proposal) + 1)]
        logits = logits.float().clone()
        apply_penalties(logits, views)
        mask_stops_before_min_tokens(logits, views, self.sampler.eos_token_ids)
        if sampling.greedy:
            tokens = _accept_greedy(proposal, argmax_rows(logits).tolist())
        else:
            logits.div_(sampling.temperature)
            probs = apply_truncation(logits.clone(), views).softmax(dim=-1)
            tokens = self._accept_sampled(seq, proposal, probs)
        if not (sampling.logprobs or sampling.top_logprobs):
            return tokens, [None] * len(tokens)
        rows = logits[: len(tokens)]
        logprobs = torch.log_softmax(rows, dim=-1)
        ids = torch.tensor(tokens, dtype=torch.int64, device=logprobs.device)
        chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
        width = min(sampling.top_logprobs, logprobs.shape[1])
        top_values, top_ids = logprobs.topk(width, dim=-1) if width else (None, None)
        out: list[SampledToken | None] = []
        for j, token in enumerate(tokens):
            top = []
            if width:
                top = list(zip(top_ids[j].tolist(), top_values[j].tolist()))
            out.append(SampledToken(token, chosen[j], top))
        return tokens, out

    def _accept_sampled(self, seq: Sequence, proposal: list[int], probs: torch.Tensor) -> list[int]:
        """Rejection sampling against a point-mass proposal (see the module docstring)."""
        generator = self.sampler.generator_for(seq, probs.device)
        uniforms = torch.rand(len(proposal), generator=generator, device=probs.device).tolist()
        tokens = []
        for j, token in enumerate(proposal):
            if uniforms[j] < float(probs[j, token]):
                tokens.append(token)
                continue
            residual = probs[j].clone()
            residual[token] = 0.0
            tokens.append(_draw(residual, generator))
            return tokens
        tokens.append(_draw(probs[len(proposal)], generator))
        return tokens

    def _record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        state = seq.speculation
        state.observe(num_proposed, num_accepted)
        state.probing = False


def _accept_greedy(proposal: list[int], targets: list[int]) -> list[int]:
    """Proposals while they equal the model's argmax, then the model's own next token."""
    accepted = 0
    while accepted < len(proposal) and targets[accepted] == proposal[accepted]:
        accepted += 1
    return proposal[:accepted] + [targets[accepted]]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` (unnormalized is fine): the sampler's exponential race."""
    noise = exponential_noise(probs, generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return int((probs / noise).argmax())


class _Position:
    """A sequence as the sampler's processing sees it at one verified position: its
    tokens so far plus the proposals before that position."""

    __slots__ = ("sampling", "token_ids", "num_prompt_tokens")
    num_pending_tokens = 0

    def __init__(self, seq: Sequence, proposed: list[int]) -> None:
        self.sampling: SamplingParams = seq.sampling
        self.token_ids = seq.token_ids + proposed
        self.num_prompt_tokens = seq.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
