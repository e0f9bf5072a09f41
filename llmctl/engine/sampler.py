"""Turn a batch of next-token logits into tokens, one row per sequence.

Order of processing, per row:
1. penalties on the raw logits: repetition (HF/CTRL style, over prompt + output:
   positive logits divided, negative ones multiplied), then frequency and presence
   (OpenAI style, over generated tokens only: ``logit -= frequency * count +
   presence * (count > 0)``);
2. ``min_tokens``: EOS and stop token ids are masked until that many were generated;
3. temperature 0 takes the argmax here; otherwise logits are divided by the temperature;
4. truncation: top-k, then top-p over the top-k renormalized distribution, then min-p
   (drop tokens whose probability is below ``min_p`` times the most likely one's);
5. sampling with the exponential-race trick (``argmax(p / q)`` with ``q ~ Exp(1)``),
   which draws from ``p`` exactly; a seeded request draws ``q`` from its own generator,
   so its tokens do not depend on its batch mates.

Logprobs are the log-softmax of the logits after steps 1-3 (penalties, min_tokens and
temperature; temperature 0 counts as 1), before truncation, so every token has a
finite value whatever top-k/top-p cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmctl.engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # set only when the request asked for logprobs
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...] = (), seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        # Unseeded requests share one stream, seeded once, so an engine run reproduces.
        self._generator: torch.Generator | None = None
        self._seed = seed

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        logits = logits.float().clone()
        apply_penalties(logits, seqs)
        mask_stops_before_min_tokens(logits, seqs, self.eos_token_ids)

        temperatures = torch.tensor(
            [1.0 if s.sampling.greedy else s.sampling.temperature for s in seqs],
            device=logits.device,
        )
        logits.div_(temperatures.unsqueeze(1))
        token_ids = logits.argmax(dim=-1)
        sampling_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        if sampling_rows:
            rows = [seqs[i] for i in sampling_rows]
            token_ids[sampling_rows] = self._sample(
                apply_truncation(logits[sampling_rows], rows), rows
            )

        results = [SampledToken(int(t)) for t in token_ids.tolist()]
        want = [i for i, s in enumerate(seqs) if s.sampling.logprobs or s.sampling.top_logprobs]
        if want:
            logprobs = torch.log_softmax(logits[want], dim=-1)
            for row, i in enumerate(want):
                result = results[i]
                result.logprob = float(logprobs[row, result.token_id])
                k = seqs[i].sampling.top_logprobs
                if k:
                    values, ids = logprobs[row].topk(min(k, logprobs.shape[1]))
                    result.top = list(zip(ids.tolist(), values.tolist()))
        return results

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.sampling.seed is None]
        if unseeded:
            noise[unseeded] = noise[unseeded].exponential_(
                generator=self._shared_generator(probs.device)
            )
        for i, seq in enumerate(seqs):
            if seq.sampling.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=probs.device)
                    seq.generator.manual_seed(seq.sampling.seed)
                noise[i].exponential_(generator=seq.generator)
        # q == 0 would turn a masked token's 0 / 0 into NaN, which argmax would pick.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self._seed)
        return self._generator


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition, frequency and presence penalties, in place."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        params = seq.sampling
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
            seen = seen[seen < vocab]
            values = logits[row, seen]
            logits[row, seen] = torch.where(
                values > 0,
                values / params.repetition_penalty,
                values * params.repetition_penalty,
            )
        if (params.frequency_penalty or params.presence_penalty) and seq.num_output_tokens:
            output = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(output[output < vocab], minlength=vocab).float()
            logits[row] -= params.frequency_penalty * counts
            logits[row] -= params.presence_penalty * (counts > 0).float()


def mask_stops_before_min_tokens(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]
) -> None:
    """Forbid EOS and stop tokens while a sequence has fewer than min_tokens, in place."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.sampling.min_tokens:
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
        k = torch.tensor(top_k, device=device).unsqueeze(1)
        sorted_logits.masked_fill_(rank >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the probability of the more likely ones is below top_p;
        # the most likely token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_p, device=device).unsqueeze(1)
        sorted_logits.masked_fill_((mass_before >= p) & (rank > 0), float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(
            dim=-1, keepdim=True
        )
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits
