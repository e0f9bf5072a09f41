"""Continuous batching with chunked prefill and preemption, on a real paged toy model.

The reference for every configuration is each request run alone with a large cache:
batching, chunking, prefix reuse and preemption must never change a token.
"""

from __future__ import annotations

import pytest

from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import InvalidRequest
from tests.helpers.paged_toy_model import VOCAB, make_engine, run, workload


@pytest.fixture(scope="module")
def reference(stories_tokenizer):
    """Each request alone, in a roomy cache, prefilled in one step."""
    results = {}
    for request in workload():
        results.update(run(make_engine(stories_tokenizer, enable_prefix_caching=False), [request]))
    return results


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_runs_equal_requests_run_alone(
    stories_tokenizer, reference, prefix_caching, block_size
) -> None:
    engine = make_engine(
        stories_tokenizer, block_size=block_size, enable_prefix_caching=prefix_caching
    )
    assert run(engine, workload()) == reference


def test_chunked_prefill_respects_the_token_and_sequence_budgets(
    stories_tokenizer, reference
) -> None:
    engine = make_engine(stories_tokenizer, max_num_batched_tokens=7, max_num_seqs=3)
    assert run(engine, workload()) == reference
    steps = engine.runner.query_lens
    assert all(sum(lens) <= 7 and len(lens) <= 3 for lens in steps)
    assert any(sum(lens) == 7 for lens in steps)
    # Prefill chunks ran in the same steps as other sequences' decodes.
    assert any(1 in lens and max(lens) > 1 for lens in steps)


def test_long_prompt_is_prefilled_over_several_steps(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, max_num_batched_tokens=8)
    prompt = list(range(3, 40))
    alone = run(make_engine(stories_tokenizer), [("a", prompt, SamplingParams(max_tokens=5))])
    assert run(engine, [("a", prompt, SamplingParams(max_tokens=5))]) == alone
    assert engine.runner.query_lens[:5] == [[8], [8], [8], [8], [5]]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_cache_keeps_outputs_exact(
    stories_tokenizer, reference, prefix_caching
) -> None:
    # 14 blocks of 4 tokens: the longest request (up to ~64 tokens) fits alone, but
    # the batch does not, so sequences are preempted and recomputed.
    engine = make_engine(
        stories_tokenizer, num_blocks=16, max_model_len=64, enable_prefix_caching=prefix_caching
    )
    assert run(engine, workload()) == reference
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_skips_shared_prompt_blocks(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, block_size=4)
    prompt = list(range(3, 23))
    run(engine, [("a", prompt, SamplingParams(max_tokens=2, temperature=0))])
    engine.runner.query_lens.clear()
    run(engine, [("b", prompt + [5, 6], SamplingParams(max_tokens=2, temperature=0))])
    assert engine.runner.query_lens[0] == [2]  # 20 of 22 prompt tokens came from the cache


def test_request_that_cannot_fit_is_refused_up_front(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequest, match=r"prompt \(20 tokens\) plus max_tokens \(50\).*64"):
        engine.add_request("a", list(range(3, 23)), SamplingParams(max_tokens=50))
    with pytest.raises(InvalidRequest, match=r"needs 10 KV blocks .* the whole cache has 8"):
        engine.add_request("b", list(range(3, 23)), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request("c", [3, VOCAB], SamplingParams())
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("d", [], SamplingParams())
    assert not engine.has_unfinished()


def test_abort_frees_every_block(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, num_blocks=64)
    for request_id, prompt, params in workload():
        engine.add_request(request_id, prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    aborted = [engine.abort(request_id) for request_id, _, _ in workload()]
    assert all(out is None or out.finish_reason == "abort" for out in aborted)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == 64
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)


def test_stop_conditions(stories_tokenizer) -> None:
    prompt = list(range(3, 15))
    free_run, _ = run(make_engine(stories_tokenizer), [("a", prompt, SamplingParams(20, 0))])["a"]
    stop_at = next(i for i, t in enumerate(free_run) if free_run.index(t) == i and i >= 3)
    token = free_run[stop_at]

    def first(config=None, **params):
        engine = make_engine(stories_tokenizer, **(config or {}))
        params = SamplingParams(**{"max_tokens": 20, "temperature": 0, **params})
        return run(engine, [("a", prompt, params)])["a"]

    assert first() == (free_run, "length")
    assert first(max_tokens=5) == (free_run[:5], "length")
    assert first(stop_token_ids=[token]) == (free_run[: stop_at + 1], "stop")
    eos = {"eos_token_ids": (token,)}
    assert first(eos) == (free_run[: stop_at + 1], "stop")
    assert first(eos, ignore_eos=True) == (free_run, "length")
    # min_tokens forbids the EOS token until enough were generated: the path changes.
    tokens, _ = first(eos, min_tokens=stop_at + 2)
    assert token not in tokens[: stop_at + 2]


def test_max_tokens_none_runs_until_the_session_is_full(stories_tokenizer):
    engine = make_engine(stories_tokenizer, max_model_len=40)
    prompt = list(range(3, 13))
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    results = run(engine, [("whole", prompt, params)])
    tokens, reason = results["whole"]
    assert (len(tokens), reason) == (40 - len(prompt), "length")
    with pytest.raises(InvalidRequest, match="leaves no room"):
        engine.add_request("full", list(range(3, 43)), params)


def test_steady_decode_steps_look_only_at_sequences_that_change(
    stories_tokenizer, monkeypatch
) -> None:
    """Once every running sequence decodes, a step is the previous one moved on: no
    sequence is scheduled one by one, and only those opening a block get one."""
    from llmctl.engine.scheduler import ScheduledStep

    added = []
    real_add = ScheduledStep.add
    monkeypatch.setattr(
        ScheduledStep,
        "add",
        lambda step, seq, count: added.append(seq) or real_add(step, seq, count),
    )
    engine = make_engine(stories_tokenizer, block_size=4)
    grown = []
    real_append = engine.block_manager.append_slots
    monkeypatch.setattr(
        engine.block_manager,
        "append_slots",
        lambda seq, count: grown.append(seq) or real_append(seq, count),
    )
    for i in range(8):
        engine.add_request(f"r{i}", list(range(3, 9)), SamplingParams(12, temperature=0))
    per_step = []
    while engine.has_unfinished():
        added.clear(), grown.clear()
        engine.step()
        per_step.append((len(added), len(grown)))
    # Admission (6 prompt tokens each), the first decode step, then steps derived from it;
    # every 4th position opens a block for all eight.
    assert per_step[0] == (8, 0) and per_step[1] == (8, 0)
    assert [adds for adds, _ in per_step[2:]] == [0] * 10
    assert sorted({blocks for _, blocks in per_step[2:]}) == [0, 8]
