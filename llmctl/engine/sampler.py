"""Turn a batch of next-token logits into tokens, one row per sequence.

Order of processing, per row:
1. the grammar's mask (structured output): the tokens a constrained row's grammar
   forbids become ``-inf`` (``grammar.apply_masks``; other rows are not touched);
2. penalties on the raw logits: repetition (HF/CTRL style, over prompt + output:
   positive logits divided, negative ones multiplied), then frequency and presence
   (OpenAI style, over generated tokens only: ``logit -= frequency * count +
   presence * (count > 0)``); then ``logit_bias`` is added;
3. ``min_tokens``: EOS and stop token ids are masked until that many were generated;
4. temperature 0 takes the argmax here; otherwise logits are divided by the temperature;
5. truncation: top-k, then top-p over the top-k renormalized distribution, then min-p
   (drop tokens whose probability is below ``min_p`` times the most likely one's);
6. sampling with the exponential-race trick (``argmax(p / q)`` with ``q ~ Exp(1)``),
   which draws from ``p`` exactly; a seeded request draws ``q`` from its own generator,
   so its tokens do not depend on its batch mates.

Logprobs are the log-softmax of the logits after steps 1-4 (grammar, penalties, bias, min_tokens and
temperature; temperature 0 counts as 1), before truncation, so every token has a
finite value whatever top-k/top-p cut.

All of it runs on the logits' device and nothing waits for the device: a step whose
rows are all plain greedy is one argmax, and the sampled ids (with the logprobs, when
asked) come back to the host in one copy (``SampledBatch``).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from llmctl.engine.sequence import Sequence
from llmctl.engine.transfer import HostCopy, to_device


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # set only when the request asked for logprobs
    top: list[tuple[int, float]] = field(default_factory=list)


class SampledBatch:
    """One step's sampled tokens: ``token_ids`` stays on the model's device (the next step
    can read it there), and one copy to the host is started at once; ``host()`` waits
    for that copy. With logprobs asked, ids and logprobs travel in the same copy."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        logprob_rows: list[int] | None = None,
        top_ks: list[int] | None = None,
        chosen: torch.Tensor | None = None,
        top_values: torch.Tensor | None = None,
        top_ids: torch.Tensor | None = None,
    ) -> None:
        self.token_ids = token_ids
        self._logprob_rows = logprob_rows or []
        self._top_ks = top_ks or []
        self._top_width = 0 if top_ids is None else top_ids.shape[1]
        if self._logprob_rows:
            # Ids below 2**53 are exact in float64, so one tensor carries everything.
            packed = torch.cat(
                [
                    token_ids.double(),
                    chosen.double(),
                    top_ids.double().flatten(),
                    top_values.double().flatten(),
                ]
            )
        else:
            packed = token_ids
        self._copy = HostCopy(packed)

    def host(self) -> tuple[list[int], dict[int, SampledToken]]:
        """The sampled ids (one per row) and, by row, the logprobs of rows that asked."""
        values = self._copy.get().tolist()
        num_rows = self.token_ids.shape[0]
        if not self._logprob_rows:
            return values, {}
        token_ids = [int(v) for v in values[:num_rows]]
        count, width = len(self._logprob_rows), self._top_width
        chosen = values[num_rows : num_rows + count]
        top_ids = values[num_rows + count : num_rows + count + count * width]
        top_values = values[num_rows + count + count * width :]
        logprobs = {}
        for i, (row, k) in enumerate(zip(self._logprob_rows, self._top_ks)):
            first = i * width
            top = [(int(top_ids[first + j]), top_values[first + j]) for j in range(k)]
            logprobs[row] = SampledToken(token_ids[row], chosen[i], top)
        return token_ids, logprobs


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...] = (), seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        # Unseeded requests share one stream, seeded once, so an engine run reproduces.
        self._generator: torch.Generator | None = None
        self._seed = seed

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: Future | None = None
    ) -> list[SampledToken]:
        """Sample and wait: one ``SampledToken`` per row."""
        token_ids, logprobs = self.sample(logits, seqs, masks).host()
        return [logprobs.get(row) or SampledToken(t) for row, t in enumerate(token_ids)]

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        masks: Future | None = None,
        *,
        plain_greedy: bool = False,
    ) -> SampledBatch:
        """Sample one token per row on the logits' device; nothing here waits for it,
        except for ``masks`` (``GrammarMasks.start``: the constrained rows' bitmasks).
        ``plain_greedy``: the caller knows every row is (else each row is looked at)."""
        if plain_greedy or all(seq.plain_greedy for seq in seqs):  # no copy of the logits
            return SampledBatch(argmax_rows(logits))
        device = logits.device
        logits = logits.float().clone()
        if masks is not None:
            from llmctl.engine.grammar import apply_masks  # xgrammar: only with grammars

            apply_masks(logits, masks.result())
        apply_penalties(logits, seqs)
        apply_logit_bias(logits, seqs)
        mask_stops_before_min_tokens(logits, seqs, self.eos_token_ids)

        temperatures = to_device(
            [1.0 if s.sampling.greedy else s.sampling.temperature for s in seqs],
            torch.float32,
            device,
        )
        logits.div_(temperatures.unsqueeze(1))
        token_ids = argmax_rows(logits)
        sampling_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        if sampling_rows:
            rows = [seqs[i] for i in sampling_rows]
            index = to_device(sampling_rows, torch.int64, device)
            token_ids[index] = self._sample(apply_truncation(logits[index], rows), rows)

        want = [i for i, s in enumerate(seqs) if s.sampling.logprobs or s.sampling.top_logprobs]
        if not want:
            return SampledBatch(token_ids)
        top_ks = [seqs[i].sampling.top_logprobs for i in want]
        index = to_device(want, torch.int64, device)
        logprobs = torch.log_softmax(logits[index], dim=-1)
        chosen = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)
        top_values, top_ids = logprobs.topk(min(max(top_ks), logprobs.shape[1]), dim=-1)
        return SampledBatch(token_ids, want, top_ks, chosen, top_values, top_ids)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.sampling.seed is None]
        if unseeded:
            index = to_device(unseeded, torch.int64, probs.device)
            generator = self._shared_generator(probs.device)
            noise[index] = exponential_noise(noise[index], generator)
        for i, seq in enumerate(seqs):
            if seq.sampling.seed is not None:
                noise[i] = exponential_noise(noise[i], self.generator_for(seq, probs.device))
        # q == 0 would turn a masked token's 0 / 0 into NaN, which argmax would pick.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def generator_for(self, seq: Sequence, device: torch.device) -> torch.Generator:
        """The random stream ``seq`` draws from: its own when seeded, else the shared one."""
        if seq.sampling.seed is None:
            return self._shared_generator(device)
        if seq.generator is None:
            seq.generator = torch.Generator(device=device)
            seq.generator.manual_seed(seq.sampling.seed)
        return seq.generator

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self._seed)
        return self._generator


def exponential_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Exp(1) draws shaped as ``like``: the values ``like.exponential_(generator=...)``
    writes. On the CPU that kernel draws one double uniform ``u`` an element, serially, and
    takes ``-log1p(-u)``; drawing the uniforms in one call and taking the logarithm over
    the tensor gives the same float32 values (same seed, same tokens) in half the time.
    The draws are what is left: 13 ns an element, 0.6 ms a row of a 49,152-token
    vocabulary. (In float64 the vectorised logarithm differs in the last bit.)"""
    if like.device.type != "cpu" or like.dtype != torch.float32:
        return torch.empty_like(like).exponential_(generator=generator)
    uniform = torch.empty(like.shape, dtype=torch.float64).uniform_(generator=generator)
    return uniform.neg_().log1p_().neg_().to(like.dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index. On the CPU numpy's argmax is an order of magnitude
    faster than torch's for a batch of vocabulary-wide rows, and picks the same index."""
    if logits.device.type == "cpu":
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1))
    return logits.argmax(dim=-1)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's ``logit_bias``: a value added to chosen tokens' logits, in place."""
    for row, seq in enumerate(seqs):
        bias = seq.sampling.logit_bias
        if bias:
            ids = to_device(list(bias), torch.int64, logits.device)
            logits[row, ids] += to_device(list(bias.values()), torch.float32, logits.device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition, frequency and presence penalties, in place."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        params = seq.sampling
        if params.repetition_penalty != 1.0:
            seen = to_device(sorted(set(seq.token_ids)), torch.int64, logits.device)
            seen = seen[seen < vocab]
            values = logits[row, seen]
            logits[row, seen] = torch.where(
                values > 0,
                values / params.repetition_penalty,
                values * params.repetition_penalty,
            )
        if (params.frequency_penalty or params.presence_penalty) and seq.num_output_tokens:
            output = to_device(seq.output_token_ids, torch.int64, logits.device)
            counts = torch.bincount(output[output < vocab], minlength=vocab).float()
            logits[row] -= params.frequency_penalty * counts
            logits[row] -= params.presence_penalty * (counts > 0).float()


def mask_stops_before_min_tokens(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]
) -> None:
    """Forbid EOS and stop tokens while a sequence has fewer than min_tokens, in place."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        # Tokens sampled but not yet seen on the host (overlapped steps) count too.
        if seq.num_output_tokens + seq.num_pending_tokens < seq.sampling.min_tokens:
            stops = set(seq.sampling.stop_token_ids)
            if not seq.sampling.ignore_eos:
                stops.update(eos_token_ids)
            for token_id in stops:
                if token_id < vocab:
                    logits[row, token_id] = float("-inf")


def apply_truncation(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask (``-inf``) the tokens top-k, top-p and min-p exclude."""
    vocab = logits.shape[1]
    top_k = [min(s.sampling.top_k, vocab) if s.sampling.top_k > 0 else vocab for s in seqs]
    top_p = [s.sampling.top_p for s in seqs]
    min_p = [s.sampling.min_p for s in seqs]
    device = logits.device
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        k = to_device(top_k, torch.int64, device).unsqueeze(1)
        sorted_logits.masked_fill_(rank >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the probability of the more likely ones is below top_p;
        # the most likely token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        p = to_device(top_p, torch.float32, device).unsqueeze(1)
        sorted_logits.masked_fill_((mass_before >= p) & (rank > 0), float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = to_device(min_p, torch.float32, device).unsqueeze(1) * probs.amax(
            dim=-1, keepdim=True
        )
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits
