"""``stream_interval``: a request's outputs come at its first token, every interval-th
and its last, each with everything since the one before. Joined, they are exactly the
outputs of a request streamed token by token: tokens, text (multi-byte characters and
stop strings), logprobs, finish reasons; also under speculation, overlapped steps and
aborts."""

from __future__ import annotations

import pytest

from llmctl.engine.config import SpeculativeConfig
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.sequence import Sequence
from tests.engine.test_overlap import ScriptedModel
from tests.helpers.paged_toy_model import make_engine, workload

INTERVALS = [2, 3, 7, 1 << 30]


def joined_outputs(engine, requests, interval):
    """request id -> (token ids, text, logprob values, finish reason, outputs seen)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params, stream_interval=interval)
    got = {request_id: ([], "", [], None, []) for request_id, _, _ in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, text, logprobs, _, seen = got[out.request_id]
            values = [(lp.token_id, lp.logprob) for lp in out.logprobs or []]
            seen.append(out)
            got[out.request_id] = (
                tokens + out.token_ids,
                text + out.text,
                logprobs + values,
                out.finish_reason,
                seen,
            )
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    return got


def without_outputs(results):
    return {rid: result[:4] for rid, result in results.items()}


def check_output_counts(results, interval):
    for tokens, _, _, _, seen in results.values():
        assert len(seen[0].token_ids) == 1 and seen[0].prompt_token_ids is not None
        assert seen[-1].finished and all(not out.finished for out in seen[:-1])
        # The first token, then one output per interval (or fewer tokens, at the end).
        assert len(seen) <= 2 + (len(tokens) - 1) // interval


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("interval", INTERVALS)
def test_joined_outputs_equal_token_by_token_ones(stories_tokenizer, overlap, interval):
    requests = [
        (rid, prompt, SamplingParams(**{**vars(params), "logprobs": True, "top_logprobs": 2}))
        for rid, prompt, params in workload(seed=3)
    ]
    every_token = joined_outputs(make_engine(stories_tokenizer, overlap=overlap), requests, 1)
    engine = make_engine(stories_tokenizer, overlap=overlap)
    coalesced = joined_outputs(engine, requests, interval)
    assert without_outputs(coalesced) == without_outputs(every_token)
    assert all(len(result[2]) == len(result[0]) for result in coalesced.values())
    check_output_counts(coalesced, interval)


@pytest.mark.parametrize("interval", INTERVALS)
def test_multibyte_text_and_stop_strings_are_whole(stories_tokenizer, interval):
    texts = ["Once upon 世界 a time", "🙂 dogs and 🙂 cats", "café naïve résumé", "a€b€c€d"]
    stops = [["界 a"], ["and 🙂"], ["ve ré"], []]
    scripts, requests, expected = {}, [], {}
    for i, (text, stop) in enumerate(zip(texts, stops)):
        prompt = [400 + i, 300, 301]
        output = stories_tokenizer.encode(text, add_special_tokens=False)
        scripts[prompt[0]] = (len(prompt), output)
        requests.append((f"r{i}", prompt, SamplingParams(len(output), 0, stop=stop)))
        whole = stories_tokenizer.decode(prompt + output)[len(stories_tokenizer.decode(prompt)) :]
        expected[f"r{i}"] = whole[: whole.find(stop[0])] if stop else whole
    for overlap in (False, True):
        engine = make_engine(stories_tokenizer, vocab_size=512, overlap=overlap)
        engine.runner = ScriptedModel(scripts, vocab_size=512)
        got = joined_outputs(engine, requests, interval)
        assert {rid: result[1] for rid, result in got.items()} == expected
        check_output_counts(got, interval)


def test_speculative_steps_hand_out_what_was_held(stories_tokenizer):
    from tests.engine.test_speculative import repetitive_workload

    speculation = SpeculativeConfig(method="ngram", num_tokens=4, ngram_max=3, ngram_min=1)
    requests = repetitive_workload(4, 16)
    every_token = joined_outputs(make_engine(stories_tokenizer), requests, 1)
    engine = make_engine(stories_tokenizer, speculation=speculation)
    assert without_outputs(joined_outputs(engine, requests, 5)) == without_outputs(every_token)
    assert engine.speculator.stats.accepted > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_an_abort_hands_out_the_held_tokens(stories_tokenizer, overlap):
    engine = make_engine(stories_tokenizer, overlap=overlap)
    prompt, params = list(range(3, 12)), SamplingParams(max_tokens=40, temperature=0)
    engine.add_request("a", prompt, params, stream_interval=1 << 30)
    outputs = []
    for _ in range(8):
        outputs += engine.step()
    outputs.append(engine.abort("a"))
    outputs += engine.step()  # overlapped: the step in flight ends, its token dropped
    tokens = [t for out in outputs for t in out.token_ids]
    assert outputs[-1].finish_reason == "abort" and len(tokens) > 2
    reference = make_engine(stories_tokenizer)
    reference.add_request("a", prompt, SamplingParams(max_tokens=len(tokens), temperature=0))
    expected = []
    while reference.has_unfinished():
        expected += [t for out in reference.step() for t in out.token_ids]
    assert tokens == expected
    assert engine.block_manager.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("mode", ["plain", "overlap", "speculation"])
@pytest.mark.parametrize("interval", INTERVALS)
def test_tokens_held_on_the_short_path_come_out_as_streamed(
    stories_tokenizer, monkeypatch, mode, interval
):
    """Without logprobs or a grammar, most held tokens are only counted (the engine's
    short path) and their texts read from the table when they go out: stop ids, EOS,
    special tokens kept or skipped, byte tokens of multi-byte characters (ids past 130
    of this 512-token vocabulary), preemption and verification steps between held
    tokens all end the same as token by token."""
    requests = []
    for i, (rid, prompt, params) in enumerate(workload(seed=8, count=12)):
        options = {**vars(params), "ignore_eos": i % 4 == 0, "skip_special_tokens": i % 3 != 2}
        if i % 5 in (3, 4):
            options["stop_token_ids"] = [449, 77]
        if mode == "speculation":  # seeded sampling draws differently when verifying
            options["temperature"] = 0.0
        requests.append((rid, prompt, SamplingParams(**options)))
    released = []
    release_held = Sequence.release_held
    monkeypatch.setattr(Sequence, "release_held", lambda seq: released.append(release_held(seq)))

    def engine():
        options = {}
        if mode == "speculation":
            options["speculation"] = SpeculativeConfig(method="ngram", num_tokens=3, ngram_min=1)
        return make_engine(
            stories_tokenizer,
            vocab_size=512,
            eos_token_ids=(0, 120),  # 0 is <unk>, a special token: r8 keeps it
            num_blocks=16,
            max_model_len=64,
            overlap=mode == "overlap",
            **options,
        )

    every_token = joined_outputs(engine(), requests, 1)
    assert not released
    tiny = engine()
    coalesced = joined_outputs(tiny, requests, interval)
    assert without_outputs(coalesced) == without_outputs(every_token)
    if mode != "speculation":  # a verification step always hands its tokens out
        check_output_counts(coalesced, interval)
    assert tiny.scheduler.num_preemptions > 0
    assert released  # the short path held tokens
    assert {result[3] for result in coalesced.values()} >= {"stop", "length"}
    if mode == "speculation":
        assert tiny.speculator.stats.accepted > 0
