"""The whole turbo engine (shared scheduler, paged KV, sampler + native step) against
transformers: greedy tokens must be identical, with many requests in flight, chunked
prefill, prefix caching and preemption under a tiny KV cache."""

from __future__ import annotations

import json
import random

import pytest

from llmctl import LLM, SamplingParams
from tests.conftest import STORIES
from tests.helpers.tiny_models import hf_greedy, load_hf_model

GREEDY = SamplingParams(max_tokens=48, temperature=0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def open_llm(model_dir, **options) -> LLM:
    llm = LLM(str(model_dir), backend="turbo", device="cpu", dtype="float32", **options)
    assert llm.backend == "turbo"
    return llm


@pytest.fixture(scope="module")
def stories_case(turbo_ops):
    """The stored reference continuations, plus prompts of other lengths (some sharing
    long prefixes, for the prefix cache) continued by transformers here."""
    if not (STORIES / "reference_greedy.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    reference = json.loads((STORIES / "reference_greedy.json").read_text())
    prompts = [r["prompt_ids"] for r in reference["results"]] + [[1]]
    expected = [r["new_token_ids"] for r in reference["results"]]
    expected.append(reference["from_bos_only"]["new_token_ids"])
    story = reference["results"][0]["prompt_ids"] + reference["results"][0]["new_token_ids"]
    extra = [story[:40], story[:40] + [286, 261], story[:75], story[:9], story[:70] + [317]]
    prompts += extra
    expected += hf_greedy(load_hf_model(STORIES), extra, GREEDY.max_tokens)
    return prompts, expected


@pytest.mark.parametrize("block_size", [16, 48, 80])
def test_stories260k_greedy_equals_transformers(stories_case, block_size):
    prompts, expected = stories_case
    with open_llm(STORIES, cache_block_seq_len=block_size) as llm:
        outputs = llm.generate(prompts, GREEDY)
        # Again, in reverse: this round reuses what the prefix cache kept.
        again = llm.generate(prompts[::-1], GREEDY)
        assert llm.engine.stats().kv_blocks_used == 0
    assert [o.token_ids for o in outputs] == expected
    assert [o.token_ids for o in again] == expected[::-1]


def test_preemption_and_chunked_prefill_keep_greedy_exact(stories_case):
    prompts, expected = stories_case
    # 7 blocks of 16 tokens hold one full 112-token session, not the whole batch.
    with open_llm(
        STORIES,
        cache_block_seq_len=16,
        cache_max_entry_count=7,
        session_len=112,
        max_prefill_token_num=24,
    ) as llm:
        short = [p for p in prompts if len(p) + 32 <= 112]
        outputs = llm.generate(short, SamplingParams(max_tokens=32, temperature=0))
        assert llm.engine.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats().kv_blocks_used == 0
    by_prompt = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    assert [o.token_ids for o in outputs] == [by_prompt[tuple(p)][:32] for p in short]


@pytest.mark.parametrize("kind", ["llama3-rope", "llama-mqa", "qwen2", "mistral"])
def test_tiny_models_greedy_equal_transformers(turbo_ops, tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    rng = random.Random(kind)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 23, 40, 70, 33, 12, 5)]
    prompts.append(prompts[3] + [rng.randrange(3, 512) for _ in range(5)])  # shared prefix
    expected = hf_greedy(load_hf_model(model_dir), prompts, 24)
    params = SamplingParams(max_tokens=24, temperature=0)
    with open_llm(model_dir, cache_block_seq_len=32) as llm:
        outputs = llm.generate(prompts, params)  # all nine in flight at once
    assert [o.token_ids for o in outputs] == expected
