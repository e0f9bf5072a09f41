"""The batched sampler: exact masks and penalties on crafted logits, seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from llmctl.engine.sampler import (
    Sampler,
    apply_penalties,
    apply_truncation,
    argmax_rows,
    exponential_noise,
    mask_stops_before_min_tokens,
)
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.sequence import Sequence

# Probabilities that are exact in binary, so cumulative sums have no rounding.
PROBS = [0.5, 0.25, 0.125, 0.0625, 0.0625]


def seq(prompt=(0,), output=(), **params) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(max_tokens=64, **params))
    s.token_ids.extend(output)  # as the engine appends sampled tokens
    return s


def kept(params: dict, probs=PROBS) -> set[int]:
    logits = torch.tensor([probs]).log()
    masked = apply_truncation(logits, [seq(**params)])
    return {i for i, v in enumerate(masked[0].tolist()) if v != float("-inf")}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"top_k": 1}, {0}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 10}, {0, 1, 2, 3, 4}),
        ({"top_p": 0.5}, {0}),  # the top token alone reaches 0.5
        ({"top_p": 0.75}, {0, 1}),
        ({"top_p": 0.76}, {0, 1, 2}),
        ({"top_p": 0.01}, {0}),  # the most likely token is always kept
        ({"min_p": 0.25}, {0, 1, 2}),  # threshold 0.125: equal is kept
        ({"min_p": 0.26}, {0, 1}),
        ({"min_p": 1.0}, {0}),
        # top-p applies to the top-k renormalized distribution: 4/7, 2/7, 1/7
        ({"top_k": 3, "top_p": 0.6}, {0, 1}),
        ({"top_k": 3, "top_p": 0.86}, {0, 1, 2}),
        ({"top_k": 4, "min_p": 0.2}, {0, 1, 2}),
    ],
)
def test_truncation_masks_exactly(params: dict, expected: set[int]) -> None:
    assert kept(params) == expected


def test_truncation_is_per_row() -> None:
    logits = torch.tensor([PROBS, PROBS[::-1]]).log()
    masked = apply_truncation(logits, [seq(top_k=1), seq(top_p=0.75)])
    assert torch.isfinite(masked[0]).tolist() == [True, False, False, False, False]
    assert torch.isfinite(masked[1]).tolist() == [False, False, False, True, True]


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])
    apply_penalties(logits, [seq(prompt=(0,), output=(1, 1), repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5, -1.0]]


def test_frequency_and_presence_penalties_over_output_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    s = seq(prompt=(0, 4), output=(2, 2, 3), frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [s])
    assert logits.tolist() == [[1.0, 1.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25, 1.0]]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, 5)
    young = seq(output=(1,), min_tokens=2, stop_token_ids=[3])
    grown = seq(output=(1, 1), min_tokens=2, stop_token_ids=[3])
    mask_stops_before_min_tokens(logits, [young, grown], eos_token_ids=(4,))
    assert torch.isinf(logits[0]).tolist() == [False, False, False, True, True]
    assert not torch.isinf(logits[1]).any()


def test_greedy_takes_argmax_after_penalties() -> None:
    sampler = Sampler()
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sampler(logits, [seq(temperature=0)])[0].token_id == 0
    penalized = seq(output=(0,), temperature=0, presence_penalty=0.5)
    assert sampler(logits, [penalized])[0].token_id == 1


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    sampler = Sampler(seed=1)
    n = 4000
    logits = torch.tensor([PROBS]).log().repeat(n, 1)
    tokens = [t.token_id for t in sampler(logits, [seq(temperature=1.0) for _ in range(n)])]
    for token, p in enumerate(PROBS):
        assert abs(tokens.count(token) / n - p) < 0.03
    truncated = [
        t.token_id for t in sampler(logits, [seq(temperature=1.0, top_k=2) for _ in range(n)])
    ]
    assert set(truncated) == {0, 1}
    assert abs(truncated.count(0) / n - 2 / 3) < 0.03


def test_seeded_requests_reproduce_whatever_their_batch_mates() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))

    def run(batch_mates: int, sampler_seed: int) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        mine = seq(temperature=1.0, seed=1234)
        others = [seq(temperature=0.7, seed=None if i % 2 else i) for i in range(batch_mates)]
        tokens = []
        for _ in range(20):
            batch = others + [mine]
            out = sampler(logits.repeat(len(batch), 1), batch)
            tokens.append(out[-1].token_id)
        return tokens

    alone = run(0, 0)
    assert run(3, 7) == alone
    assert run(5, 99) == alone
    assert len(set(alone)) > 3  # really sampling, not collapsing to one token


def test_unseeded_sampling_reproduces_for_same_engine_seed() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    first = [t.token_id for t in Sampler(seed=5)(logits, [seq() for _ in range(4)])]
    again = [t.token_id for t in Sampler(seed=5)(logits, [seq() for _ in range(4)])]
    assert first == again


def test_logprobs_and_top_logprobs() -> None:
    logits = torch.tensor([PROBS]).log()
    out = Sampler()(logits, [seq(temperature=0, logprobs=True, top_logprobs=3)])[0]
    assert out.token_id == 0
    assert out.logprob == pytest.approx(math.log(0.5), abs=1e-6)
    assert [t for t, _ in out.top] == [0, 1, 2]
    assert [lp for _, lp in out.top] == pytest.approx([math.log(p) for p in PROBS[:3]], abs=1e-6)
    plain = Sampler()(logits, [seq(temperature=0)])[0]
    assert plain.logprob is None and plain.top == []


def test_logprobs_reflect_temperature() -> None:
    logits = torch.tensor([PROBS]).log()
    out = Sampler()(logits, [seq(temperature=0.5, seed=0, logprobs=True)])[0]
    expected = torch.log_softmax(logits / 0.5, dim=-1)[0, out.token_id]
    assert out.logprob == pytest.approx(float(expected), abs=1e-6)


def test_seeded_tokens_are_those_sampled_before_the_sampler_moved_to_the_device() -> None:
    """Pinned: what the sampler drew before issue 14 (per-row loops, torch's argmax) for
    these logits and seeds, eight steps of six rows mixing greedy, seeded and unseeded
    rows with top-k, top-p, min-p and penalties. Same seed, same tokens."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(7)) * 2
    params = [
        dict(temperature=0.8, seed=11),
        dict(temperature=1.0, top_k=5, seed=12),
        dict(temperature=0.0),
        dict(temperature=1.3, top_p=0.9),
        dict(temperature=0.7, min_p=0.05, seed=13, repetition_penalty=1.2),
        dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3),
    ]
    seqs = [seq(prompt=(1, 2, 3, i + 4), output=(5, 5), **p) for i, p in enumerate(params)]
    sampler = Sampler(seed=3)
    steps = [[t.token_id for t in sampler(logits, seqs)] for _ in range(8)]
    assert [list(row) for row in zip(*steps)] == [
        [15, 18, 18, 21, 35, 15, 21, 35],
        [33, 1, 33, 33, 2, 1, 1, 16],
        [25, 25, 25, 25, 25, 25, 25, 25],
        [16, 5, 28, 6, 5, 28, 1, 7],
        [36, 25, 36, 4, 26, 35, 36, 4],
        [22, 26, 19, 18, 19, 34, 22, 3],
    ]


def test_greedy_rows_take_the_first_largest_logit() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=generator)
    logits[5, [7, 100, 200]] = 50.0  # a tie: the first index wins, as torch.argmax picks
    logits[9, :] = 1.0
    expected = logits.argmax(dim=-1).tolist()
    assert expected[5] == 7 and expected[9] == 0
    assert argmax_rows(logits).tolist() == expected
    sampled = Sampler().sample(logits, [seq(temperature=0) for _ in range(64)])
    assert sampled.host() == (expected, {})


def test_logprob_rows_come_back_with_the_ids_in_one_copy() -> None:
    logits = torch.tensor([PROBS, PROBS[::-1], PROBS]).log()
    seqs = [
        seq(temperature=0, logprobs=True),
        seq(temperature=0),
        seq(temperature=0, top_logprobs=2),
    ]
    token_ids, logprobs = Sampler().sample(logits, seqs).host()
    assert token_ids == [0, 4, 0]
    assert set(logprobs) == {0, 2}
    assert logprobs[0].logprob == pytest.approx(math.log(0.5), abs=1e-6) and logprobs[0].top == []
    assert [t for t, _ in logprobs[2].top] == [0, 1]


@pytest.mark.parametrize("shape", [(1, 49152), (6, 517), (33,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_exponential_noise_is_what_exponential_draws(shape, dtype) -> None:
    """The same values as torch's own ``exponential_`` from the same generator state, and
    the generator left where that leaves it (same seed, same tokens)."""
    for seed in (0, 7, 2**40 + 3):
        like = torch.empty(shape, dtype=dtype)
        torch_generator = torch.Generator().manual_seed(seed)
        ours = torch.Generator().manual_seed(seed)
        for _ in range(2):
            expected = like.clone().exponential_(generator=torch_generator)
            got = exponential_noise(like, ours)
            assert got.dtype == dtype and torch.equal(got, expected)
        assert torch.equal(torch.rand(4, generator=ours), torch.rand(4, generator=torch_generator))
