"""A steady decode keeps its held tokens by step (``HeldSteps``) and syncs a sequence
only where something reads it. Every output must be the one the engine gives with that
switched off, and joined, the same as streamed token by token: stop ids, EOS, byte
tokens of multi-byte characters, blocks opened and keyed mid-chain (prefix hits for
later requests), preemption and aborts in the middle of a chain."""

from __future__ import annotations

import random

import pytest

from llmctl.engine.held_steps import HeldSteps
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.sampling_params import SamplingParams
from tests.helpers.paged_toy_model import make_engine


def requests(seed: int, count: int = 40):
    """Requests of varied lengths, a third sharing a 20-token prefix, greedy, sampled and
    seeded, some with logprobs, over a 512-token vocabulary whose ids past 130 include
    byte tokens of multi-byte text."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    result = []
    for i in range(count):
        own = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))]
        options = {
            "max_tokens": rng.randrange(8, 70),
            "temperature": (0.0, 0.9, 1.2)[i % 3],
            "seed": i if i % 6 == 2 else None,  # the others share the engine's stream
            "logprobs": i % 7 == 1,
            "ignore_eos": i % 4 == 0,
            "skip_special_tokens": i % 3 != 2,
        }
        if i % 5 in (3, 4):
            options["stop_token_ids"] = [449, 77]
        prompt = shared + own if i % 3 == 1 else own
        result.append((f"r{i}", prompt, SamplingParams(**options)))
    return result


def outputs(engine: LLMEngine, workload, interval: int) -> list[tuple]:
    """Every output, in order; three running requests are aborted after the 15th step."""
    for request_id, prompt, params in workload:
        engine.add_request(request_id, prompt, params, stream_interval=interval)
    seen = []
    steps = 0
    while engine.has_unfinished():
        got = engine.step()
        steps += 1
        if steps == 15:
            aborted = [seq.request_id for seq in engine.scheduler.running[1:8:3]]
            got += [engine.abort(request_id) for request_id in aborted]
        seen += [
            (
                out.request_id,
                out.text,
                out.token_ids,
                out.completion_tokens,
                out.finish_reason,
                out.cached_tokens,
                [(lp.token_id, lp.logprob) for lp in out.logprobs or []],
            )
            for out in got
        ]
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    return seen


def joined(seen: list[tuple]) -> dict[str, tuple]:
    """request id -> (token ids, text, finish reason, prompt tokens from the cache,
    logprobs)."""
    result: dict[str, tuple] = {}
    for request_id, text, token_ids, _, reason, cached, logprobs in seen:
        tokens, joined_text, _, first_cached, values = result.get(
            request_id, ([], "", None, cached, [])
        )
        result[request_id] = (
            tokens + token_ids,
            joined_text + text,
            reason,
            first_cached,
            values + logprobs,
        )
    return result


def with_follow_ups(workload, results: dict[str, tuple]):
    """``workload`` and requests admitted later whose prompts are earlier requests'
    prompts and outputs: they hit blocks keyed in the middle of a chain."""
    follow_ups = []
    for request_id, prompt, _ in workload:
        tokens = results[request_id][0]
        if len(tokens) >= 24 and len(follow_ups) < 6:
            params = SamplingParams(max_tokens=8, temperature=0.0)
            follow_ups.append((f"{request_id}-again", prompt + tokens[:-2], params))
    return workload + follow_ups


@pytest.mark.parametrize("cache_tokens", [896, 8192])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("interval", [3, 16, 1 << 30])
@pytest.mark.parametrize("overlap", [False, True])
def test_tokens_kept_by_step_come_out_as_without(
    stories_tokenizer, monkeypatch, cache_tokens, block_size, interval, overlap
):
    """Also where steps overlap (the GPU's way): there a step's K/V is marked as it is
    launched, a step before its tokens come, and the blocks a sync completes are keyed
    only once their last token is here."""
    held_rows = []
    hold = HeldSteps.hold
    monkeypatch.setattr(
        HeldSteps,
        "hold",
        lambda self, *args: held_rows.append(len(self._seqs)) or hold(self, *args),
    )

    def engine():
        return make_engine(
            stories_tokenizer,
            vocab_size=512,
            eos_token_ids=(0, 120),  # 0 is <unk>, a special token
            num_blocks=cache_tokens // block_size,
            block_size=block_size,
            max_model_len=128,
            max_num_seqs=24,  # the rest wait: admitted as others finish
            overlap=overlap,
        )

    # Overlapped steps interleave the shared sampling stream otherwise: a seed of its own
    # gives each case requests that still end all three ways (checked below).
    workload = requests(seed=cache_tokens + block_size + interval % 97 + 6 * overlap)
    workload = with_follow_ups(workload, joined(outputs(engine(), workload, 1)))
    every_token = outputs(engine(), workload, 1)
    assert not held_rows  # every token goes out: nothing to keep
    kept_engine = engine()
    kept = outputs(kept_engine, workload, interval)
    assert held_rows  # steps kept their tokens
    assert joined(kept) == joined(every_token)
    monkeypatch.setattr(LLMEngine, "_may_hold", lambda self, step: False)
    assert outputs(engine(), workload, interval) == kept  # output by output
    results = joined(kept)
    assert {result[2] for result in results.values()} >= {"stop", "length", "abort"}
    if cache_tokens < 8192:
        assert kept_engine.scheduler.num_preemptions > 0
    else:  # nothing evicted: blocks keyed as their sequences were synced are hit
        assert any(results[rid][3] > 24 for rid, _, _ in workload if rid.endswith("again"))
