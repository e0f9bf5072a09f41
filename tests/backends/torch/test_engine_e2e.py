"""The whole torch engine (scheduler, paged KV, sampler, runner) against transformers.

Greedy tokens must be identical to ``transformers.generate(do_sample=False)`` on the
same weights, whatever the block size, prefix caching, batch mix or cache pressure.
"""

from __future__ import annotations

import json
import random

import pytest

from llmctl import LLM, SamplingParams
from tests.conftest import STORIES
from tests.helpers.tiny_models import hf_greedy, load_hf_model

NEW_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def open_llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), backend="torch", device="cpu", dtype="float32", **options)


@pytest.fixture(scope="module")
def stories_case():
    """Reference prompts with their stored continuations, plus prompts of other lengths
    (some sharing long prefixes, to exercise the prefix cache) computed here."""
    if not (STORIES / "reference_greedy.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    reference = json.loads((STORIES / "reference_greedy.json").read_text())
    prompts = [r["prompt_ids"] for r in reference["results"]] + [[1]]
    expected = [r["new_token_ids"] for r in reference["results"]]
    expected.append(reference["from_bos_only"]["new_token_ids"])
    story = reference["results"][0]["prompt_ids"] + reference["results"][0]["new_token_ids"]
    extra = [story[:40], story[:40] + [286, 261], story[: 150 // 2], story[:9], story[:70] + [317]]
    prompts += extra
    expected += hf_greedy(load_hf_model(STORIES), extra, 48)
    return prompts, expected


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_stories260k_greedy_equals_transformers(stories_case, block_size, prefix_caching):
    prompts, expected = stories_case
    with open_llm(
        STORIES, cache_block_seq_len=block_size, enable_prefix_caching=prefix_caching
    ) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0))
        # Run again: the second round reuses whatever the prefix cache kept.
        again = llm.generate(prompts[::-1], SamplingParams(max_tokens=48, temperature=0))
        assert llm.engine.stats().kv_blocks_used == 0
    assert [o.token_ids for o in outputs] == expected
    assert [o.token_ids for o in again] == expected[::-1]
    assert outputs[0].finish_reason == "length"


def test_stories260k_text_matches_the_reference(stories_case):
    reference = json.loads((STORIES / "reference_greedy.json").read_text())
    with open_llm(STORIES, cache_block_seq_len=16) as llm:
        outputs = llm.generate(
            [r["prompt"] for r in reference["results"]],
            SamplingParams(max_tokens=48, temperature=0),
        )
    for out, ref in zip(outputs, reference["results"]):
        assert out.prompt_token_ids == ref["prompt_ids"]
        assert ref["prompt"] + out.text == ref["full_text"]


def test_preemption_under_a_tiny_cache_keeps_greedy_exact(stories_case):
    prompts, expected = stories_case
    # 7 blocks of 16 tokens: one full session of 112 tokens fits, the batch does not.
    with open_llm(STORIES, cache_block_seq_len=16, cache_max_entry_count=7, session_len=112) as llm:
        short = [p for p in prompts if len(p) + 32 <= 112]
        outputs = llm.generate(short, SamplingParams(max_tokens=32, temperature=0))
        assert llm.engine.engine.scheduler.num_preemptions > 0
        assert llm.engine.stats().kv_blocks_used == 0
    by_prompt = {tuple(p): e for p, e in zip(prompts, expected)}
    assert [o.token_ids for o in outputs] == [by_prompt[tuple(p)][:32] for p in short]


def test_chunked_prefill_keeps_greedy_exact(stories_case):
    prompts, expected = stories_case
    with open_llm(STORIES, cache_block_seq_len=16, max_prefill_token_num=24) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("kind", ["llama3-rope", "llama-mqa", "mistral", "qwen2", "qwen3"])
def test_tiny_models_greedy_equal_transformers(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    rng = random.Random(kind)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 23, 40, 70)]
    prompts.append(prompts[3] + [rng.randrange(3, 512) for _ in range(5)])  # shared prefix
    expected = hf_greedy(load_hf_model(model_dir), prompts, NEW_TOKENS)
    with open_llm(model_dir, cache_block_seq_len=16, max_prefill_token_num=64) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert [o.token_ids for o in outputs] == expected


def test_sampling_through_the_api(stories_case):
    prompts, _ = stories_case
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    with open_llm(STORIES, cache_block_seq_len=16) as llm:
        alone = llm.generate([prompts[0]], seeded)[0].token_ids
        crowded = llm.generate(
            [prompts[1], prompts[0], prompts[2]],
            [SamplingParams(max_tokens=16, temperature=1.0), seeded, seeded],
        )
        logprobs = llm.generate(
            [prompts[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
        )[0]
        chat = llm.chat([{"role": "user", "content": "Once upon a time"}], seeded)[0]
    assert crowded[1].token_ids == alone
    assert len(logprobs.logprobs) == 4
    for entry, token in zip(logprobs.logprobs, logprobs.token_ids):
        assert entry.token_id == token and entry.top[0][0] == token
        assert entry.logprob == pytest.approx(entry.top[0][2])
    assert chat.prompt_token_ids == prompts[0]  # no template: plain continuation
