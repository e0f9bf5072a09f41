"""Speculative decoding in the shared engine, over the paged toy model: the n-gram
proposer against a plain-Python lookup, KV rollback in the block manager, greedy output
unchanged token for token (block sizes, preemption, the prefix cache, stops), blocks
back to zero after aborts mid-speculation, and sampled output distributed as without
speculation (chi-square)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.config import SpeculativeConfig
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.sequence import Sequence
from llmctl.engine.speculative import SpecState, propose_ngram
from tests.helpers.paged_toy_model import make_engine, run

NGRAM = SpeculativeConfig(method="ngram", num_tokens=4, ngram_max=3, ngram_min=1)


def reference_lookup(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix, by brute force."""
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposer_matches_a_brute_force_lookup():
    rng = random.Random(0)
    for _ in range(400):
        vocab = rng.randrange(2, 12)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        low = rng.randrange(1, 4)
        high = rng.randrange(low, 6)
        k = rng.randrange(1, 6)
        assert propose_ngram(tokens, low, high, k) == reference_lookup(tokens, low, high, k)


def test_the_latest_repeat_kept_as_the_text_grows_matches_a_search():
    """``SpecState.latest_repeat``, asked as tokens arrive one or several at a time, says
    what a search of the whole text says: where the tokens after the latest earlier
    occurrence of its last n tokens start. Where there is one, its continuation is the
    n-gram proposer's proposal with n as the longest match."""
    rng = random.Random(5)
    for n in (1, 2, 4):
        state, text = SpecState(), []
        while len(text) < 300:
            text += [rng.randrange(6) for _ in range(rng.choice((1, 1, 3)))]
            places = [i for i in range(len(text) - n) if text[i : i + n] == text[-n:]]
            start = places[-1] + n if places and len(text) > n else None
            assert state.latest_repeat(text, n) == start
            if start is not None:
                assert text[start : start + 3] == propose_ngram(text, 1, n, 3)


def test_ngram_proposer_prefers_the_longest_suffix():
    # "1 2" occurred followed by 7, but "9 1 2" occurred followed by 5: the longer wins.
    tokens = [9, 1, 2, 5, 6, 1, 2, 7, 8, 9, 1, 2]
    assert propose_ngram(tokens, 1, 3, 2) == [5, 6]
    assert propose_ngram(tokens, 1, 2, 2) == [7, 8]
    assert propose_ngram([1, 2, 3], 1, 3, 4) == []


def seq_with(tokens: int, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(range(100, 100 + tokens)), SamplingParams(max_tokens=64))


@pytest.mark.parametrize("block_size", [4, 16])
def test_truncate_returns_exactly_the_blocks_past_the_tokens(block_size):
    manager = BlockManager(num_blocks=32, block_size=block_size, enable_prefix_caching=True)
    seq = seq_with(2 * block_size - 1)
    manager.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens - 1
    # A verification step of 1 + 2 * block_size positions: two more blocks.
    count = 1 + 2 * block_size
    manager.append_slots(seq, count)
    seq.num_computed_tokens += count
    assert len(seq.block_table) == 4
    assert manager.num_free_blocks == 32 - 4
    manager.cache_computed_blocks(seq)  # what the engine does not do: it waits
    # Three proposals accepted (token ids on the host now), the rest rejected.
    seq.token_ids += [1, 2, 3, 4]  # accepted + bonus
    seq.block_hashes = seq.block_hashes[: (seq.num_tokens - 1) // block_size]
    manager.truncate(seq, seq.num_tokens - 1)
    assert seq.num_computed_tokens == seq.num_tokens - 1
    assert len(seq.block_table) == manager.blocks_needed(seq.num_tokens)
    assert manager.num_free_blocks == 32 - len(seq.block_table)
    manager.free(seq)
    assert manager.num_free_blocks == 32


def test_truncate_refuses_to_roll_forward():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = seq_with(5)
    manager.allocate(seq)
    with pytest.raises(ValueError, match="roll"):
        manager.truncate(seq, 3)


def repetitive_workload(seed: int, count: int, vocab: int = 64, sampled: bool = False):
    """Prompts that repeat a short phrase (so prompt lookup proposes), some not at all."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
        prompt = phrase * rng.randrange(1, 5) + [rng.randrange(3, vocab)]
        if i % 4 == 3:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0)
        if sampled and i % 2:
            params = SamplingParams(max_tokens=rng.randrange(1, 30), temperature=1.0, seed=i)
        requests.append((f"r{i}", prompt, params))
    return requests


@pytest.mark.parametrize("block_size", [4, 16, 64, 128])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_output_is_unchanged_by_speculation(stories_tokenizer, block_size, prefix_caching):
    requests = repetitive_workload(block_size, 16)
    # Twice the same workload, so the second round hits the prefix cache.
    requests += [(f"again-{rid}", prompt, params) for rid, prompt, params in requests]
    options = dict(block_size=block_size, enable_prefix_caching=prefix_caching)
    plain = run(make_engine(stories_tokenizer, **options), requests)
    engine = make_engine(stories_tokenizer, speculation=NGRAM, **options)
    assert run(engine, requests) == plain
    stats = engine.speculator.stats
    assert stats.proposed > 0 and 0 < stats.accepted <= stats.proposed
    # After the first step (every prompt), steps verified several positions at once.
    assert any(max(lens) > 1 for lens in engine.runner.query_lens[1:])


def test_plain_greedy_verification_takes_the_runners_argmax(stories_tokenizer):
    """Steps that verify plain greedy requests' proposals go through a runner's
    ``execute_greedy`` (turbo's CPU LM head finds each row's argmax as it writes it; the
    toy runner has none, so the test gives it one), and the engine takes those ids
    without reading the logits again: here poisoned with NaN after the argmax."""
    from llmctl.engine.sampler import argmax_rows

    requests = repetitive_workload(7, 16)
    plain = run(make_engine(stories_tokenizer), requests)
    engine = make_engine(stories_tokenizer, speculation=NGRAM)
    verifications = []

    def poisoned(batch):
        logits = engine.runner.execute(batch)
        greedy_ids = argmax_rows(logits)
        rows = batch.logits_indices
        verifications.append(rows is not None and len(rows) > batch.num_seqs)
        return torch.full_like(logits, float("nan")), greedy_ids

    engine._execute_greedy = poisoned
    assert run(engine, requests) == plain
    assert any(verifications)
    assert engine.speculator.stats.accepted > 0


def test_greedy_output_is_unchanged_under_preemption(stories_tokenizer):
    requests = repetitive_workload(1, 12)
    # 24 blocks of 4 tokens for 12 requests of up to ~50 tokens: they preempt each other.
    options = dict(num_blocks=24, block_size=4, max_model_len=96, enable_prefix_caching=True)
    plain = run(make_engine(stories_tokenizer, **options), requests)
    engine = make_engine(stories_tokenizer, speculation=NGRAM, **options)
    assert run(engine, requests) == plain
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.stats.accepted > 0


def test_stop_tokens_and_max_tokens_are_exact(stories_tokenizer):
    requests = repetitive_workload(2, 16)
    plain = run(make_engine(stories_tokenizer), requests)
    # Stop at a token each greedy answer produces in the middle: never one past it.
    stopped = []
    for request_id, prompt, params in requests:
        tokens, _ = plain[request_id]
        if len(tokens) > 3:
            stop = SamplingParams(
                max_tokens=params.max_tokens, temperature=0, stop_token_ids=[tokens[2]]
            )
            stopped.append((request_id, prompt, stop))
    want = run(make_engine(stories_tokenizer), stopped)
    got = run(make_engine(stories_tokenizer, speculation=NGRAM), stopped)
    assert got == want
    assert all(reason == "stop" for _, reason in got.values())
    for request_id, _, params in requests:
        assert len(plain[request_id][0]) == params.max_tokens


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(stories_tokenizer):
    requests = [
        (
            rid,
            prompt,
            SamplingParams(
                max_tokens=params.max_tokens, temperature=0, logprobs=True, top_logprobs=2
            ),
        )
        for rid, prompt, params in repetitive_workload(3, 8)
    ]

    def collect(engine):
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        got = {rid: [] for rid, _, _ in requests}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
        return got

    want = collect(make_engine(stories_tokenizer))
    engine = make_engine(stories_tokenizer, speculation=NGRAM)
    got = collect(engine)
    assert engine.speculator.stats.accepted > 0
    for rid in want:
        assert [t for t, _, _ in got[rid]] == [t for t, _, _ in want[rid]]
        for (_, a, top_a), (_, b, top_b) in zip(got[rid], want[rid]):
            assert a == pytest.approx(b, abs=1e-5)
            assert [i for i, _, _ in top_a] == [i for i, _, _ in top_b]


def test_blocks_return_to_zero_after_aborts_mid_speculation(stories_tokenizer):
    engine = make_engine(stories_tokenizer, speculation=NGRAM)
    requests = repetitive_workload(4, 10)
    for rid, prompt, _ in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=40, temperature=0))
    verified = 0
    manager = engine.block_manager
    while engine.has_unfinished():
        engine.step()
        # Exact counts mid-run: no sequence keeps a block past its tokens (rejected
        # positions rolled back), and the pool's count is the blocks the tables hold.
        held = set()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= manager.blocks_needed(seq.num_tokens), seq
            held.update(seq.block_table)
        assert manager.num_used_blocks == len(held)
        if engine.speculator.stats.steps > verified:  # a step verified proposals: abort one
            verified = engine.speculator.stats.steps
            running = engine.scheduler.running
            if running:
                engine.abort(running[len(running) // 2].request_id)
    assert verified > 0
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)


def chi_square_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square test of homogeneity on counts ``a`` and ``b``."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    total = a + b
    expected_a = total * a.sum() / total.sum()
    expected_b = total * b.sum() / total.sum()
    stat = (((a - expected_a) ** 2) / expected_a + ((b - expected_b) ** 2) / expected_b).sum()
    dof = len(a) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        pytest.param(
            dict(temperature=1.5, top_k=6, top_p=0.95, repetition_penalty=1.1),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["plain", "top-k-top-p-penalty"],
)
def test_sampled_tokens_are_distributed_as_without_speculation(stories_tokenizer, params):
    """Over 1,500 seeds, the tokens at output positions 1-4 (where proposals are verified)
    follow the same distribution with and without speculation: a chi-square test of
    homogeneity at 0.1 % significance, per position, on an 8-token vocabulary."""
    vocab, seeds, positions = 8, 1500, 4
    # Every token occurs in the prompt, so prompt lookup proposes at every step.
    prompt = [3, 4, 5, 0, 1, 2, 6, 7, 3, 4, 5, 0, 1, 2, 6, 7, 3, 4]

    def frequencies(speculation):
        engine = make_engine(
            stories_tokenizer, vocab_size=vocab, num_blocks=4096, speculation=speculation
        )
        requests = [
            (f"s{seed}", prompt, SamplingParams(max_tokens=positions, seed=seed, **params))
            for seed in range(seeds)
        ]
        results = run(engine, requests)
        counts = np.zeros((positions, vocab), dtype=np.int64)
        for tokens, _ in results.values():
            for position, token in enumerate(tokens):
                counts[position, token] += 1
        return counts, engine

    plain, _ = frequencies(SpeculativeConfig())
    # ngram_max 1: a request starts proposing only where its last ngram_max tokens occur
    # earlier, and with one-token suffixes every request here does at once.
    spec, engine = frequencies(SpeculativeConfig("ngram", num_tokens=3, ngram_max=1))
    assert engine.speculator.stats.steps >= seeds  # every request speculated
    assert 0 < engine.speculator.stats.accepted < engine.speculator.stats.proposed
    for position in range(1, positions):
        p_value = chi_square_p_value(plain[position], spec[position])
        assert p_value > 0.001, (position, plain[position], spec[position])


def steps_costing(
    speculator, base: float, per_token: float, tokens_per_second: float, verifying: float = 0.0
) -> None:
    """Feed the speculator's cost fit steps of 1 to 8 tokens costing ``base + per_token *
    tokens`` seconds (plus ``verifying`` for those that verify: every other one, when
    set), each emitting tokens at ``tokens_per_second``."""
    for i, tokens in enumerate((1, 5, 2, 8, 3, 1, 4, 6, 2, 5)):
        verifies = bool(verifying) and i % 2 == 1
        seconds = base + per_token * tokens + verifying * verifies
        speculator.step_seconds(tokens, seconds, round(seconds * tokens_per_second), verifies)


def test_a_request_whose_proposals_do_not_pay_pauses_and_tries_again():
    from llmctl.engine.sampler import Sampler
    from llmctl.engine.speculative import MAX_PAUSE_STEPS, SpecState, Speculator

    speculator = Speculator(NGRAM, Sampler())
    # 1 ms per step plus 0.1 ms per token, 1000 tokens/s: a proposal pays above 10 %.
    steps_costing(speculator, 0.001, 0.0001, 1000.0)
    assert speculator.cost.fit == pytest.approx((0.001, 0.0001, 0.0))
    assert speculator.cost.rate == pytest.approx(1000.0, rel=0.05)
    greedy = SamplingParams(max_tokens=100, temperature=0)
    rejected, accepted = Sequence("a", [1, 2, 3], greedy), Sequence("b", [1, 2, 3], greedy)
    rejected.speculation, accepted.speculation = SpecState(), SpecState()
    logits = torch.full((5, 16), -5.0)
    logits[:, 7] = 5.0  # the model always says 7
    proposals, accepted_proposals = [], []
    for _ in range(120):
        count = speculator.num_proposals(rejected.speculation)
        proposals.append(count)
        if count:
            assert speculator.verify(rejected, [5] * count, logits[: count + 1]) == ([7], [None])
        count = speculator.num_proposals(accepted.speculation)
        accepted_proposals.append(count)
        tokens = speculator.verify(accepted, [7] * count, logits[: count + 1])
        assert tokens == ([7] * (count + 1), [None] * (count + 1))
    # A probe of one token first, then (p = 3/4: 0.75**4 > 0.1) all it may.
    assert accepted_proposals == [1] + [NGRAM.num_tokens] * 119
    # Always rejected: after the probe p falls below what two tokens need, then below what
    # one needs, and it pauses; each pause (1 step, 2, 4 ... 32) ends with a probe of one
    # token, and as that is rejected too, the next pause is twice as long.
    assert proposals[:6] == [1, 1, 1, 1, 0, 0]
    probes = [i for i, count in enumerate(proposals) if count][3:]
    assert [proposals[i] for i in probes] == [1] * len(probes)
    pauses = [1, 2, 4, 8, 16, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS]
    assert list(np.diff(probes)) == [pause + 2 for pause in pauses]  # + the decision, the probe
    assert speculator.stats.stopped_requests == 1  # counted once, however often it pauses


def test_how_many_tokens_pay_follows_acceptance_and_the_cost_of_a_token():
    from llmctl.engine.sampler import Sampler
    from llmctl.engine.speculative import SpecState, Speculator

    config = SpeculativeConfig(method="ngram", num_tokens=16, ngram_max=3, ngram_min=1)
    speculator = Speculator(config, Sampler())
    nine_in_ten = SpecState(
        hits=9.0, misses=1.0, probing=False
    )  # p = 0.9: the j-th pays while 0.9**j > bar
    half = SpecState(hits=1.0, misses=1.0, probing=False)
    # Batch 1, memory-bound: a token adds 2 % of a step, ~1 token per step: bar 0.02.
    steps_costing(speculator, 0.01, 0.0002, 100.0)
    assert speculator.num_proposals(nine_in_ten) == 16  # 0.9**16 = 0.185 > 0.02
    assert speculator.num_proposals(half) == 5  # 0.5**5 = 0.031 > 0.02 > 0.5**6
    # A compute-bound batch: a token adds as much as a step costs, 2 tokens per step each.
    speculator = Speculator(config, Sampler())
    steps_costing(speculator, 0.001, 0.001, 400.0)  # bar 0.001 * 400 = 0.4
    assert speculator.num_proposals(nine_in_ten) == 8  # 0.9**8 = 0.43 > 0.4 > 0.9**9
    assert speculator.num_proposals(half) == 1
    assert (
        speculator.num_proposals(SpecState(hits=1.0, misses=2.0, probing=False)) == 0
    )  # 1/3 < 0.4: paused
    # Nothing rejected for hundreds of steps: the misses underflow to nothing and p is
    # exactly 1.0 (a draft that is the target itself); every proposal pays.
    always = SpecState(hits=40.0, misses=0.5 * 0.9**400, probing=False)
    assert always.acceptance == 1.0
    assert speculator.num_proposals(always) == 16


def test_a_prompt_step_counts_in_the_rate_but_not_in_the_fit():
    """A prefill's tokens have no logits, so they cost less than a verified position:
    one long prompt step in the least squares would set the slope for a hundred steps and
    push what each verified position costs into ``c``. It only moves the rate."""
    from llmctl.engine.sampler import Sampler
    from llmctl.engine.speculative import Speculator

    speculator = Speculator(NGRAM, Sampler())
    steps_costing(speculator, 0.003, 0.0004, 500.0, verifying=0.0001)
    fit, rate = speculator.cost.fit, speculator.cost.rate
    assert fit == pytest.approx((0.003, 0.0004, 0.0001))
    # 2,576 prompt tokens at 0.26 ms each, 16 tokens emitted.
    speculator.step_seconds(2576, 0.68, 16, 0, decodes=False)
    assert speculator.cost.fit == fit
    assert speculator.cost.rate < 0.5 * rate
    # Counted as a decode, the one step would have set the slope to its own.
    speculator.step_seconds(2576, 0.68, 16, 0)
    assert speculator.cost.fit[1] == pytest.approx(0.68 / 2576, rel=0.05)


def test_what_verifying_costs_besides_its_tokens_is_fitted_and_weighed():
    from llmctl.engine.sampler import Sampler
    from llmctl.engine.speculative import SpecState, Speculator

    speculator = Speculator(NGRAM, Sampler())
    # 10 ms a step, 0.2 ms a token, 4 ms more for a verification; one token a step.
    steps_costing(speculator, 0.01, 0.0002, 100.0, verifying=0.004)
    assert speculator.cost.fit == pytest.approx((0.01, 0.0002, 0.004))
    rate = speculator.cost.rate
    assert 80 < rate < 130
    # One in five accepted: 0.2 and 0.04 beat the bar (0.0002 x rate < 0.02) for two
    # tokens, but 0.24 tokens do not make up for the 4.4 ms (about 0.5 tokens) they and
    # the verification add: it pauses. One in two: 4 tokens (0.94) pay for 4.8 ms.
    assert speculator.num_proposals(SpecState(hits=1.0, misses=4.0, probing=False)) == 0
    assert speculator.num_proposals(SpecState(hits=1.0, misses=1.0, probing=False)) == 4
