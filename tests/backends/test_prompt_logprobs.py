"""Prompt logprobs (``SamplingParams.prompt_logprobs``, behind ``echo`` with logprobs on
/v1/completions) on both native backends, against transformers' log_softmax on the same
weights: every prompt token's logprob, its rank and the top alternatives, also when the
prompt is prefilled in chunks, when another request already cached its prefix (the prefix
cache must not skip the positions scored), beside requests that do not ask, and when a
tiny KV budget preempts requests mid-prompt."""

from __future__ import annotations

import random

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.llm_engine import LLMEngine
from tests.helpers.tiny_models import load_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP = 3


@pytest.fixture(params=["torch", "turbo"])
def backend(request):
    if request.param == "turbo":
        from llmctl_turbo.build import load_ops

        load_ops()
    return request.param


def reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities ``[len(prompt) - 1, vocab]``: row j scores token j + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(entries, prompt: list[int], want: torch.Tensor) -> None:
    assert len(entries) == len(prompt)
    assert entries[0].token_id == prompt[0] and entries[0].logprob is None
    for j, entry in enumerate(entries[1:]):
        row = want[j]
        token = prompt[j + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=2e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        top_ids = [token_id for token_id, _, _ in entry.top]
        values = [value for _, _, value in entry.top]
        assert len(top_ids) == TOP
        assert values == pytest.approx(row.topk(TOP).values.tolist(), abs=2e-4)
        assert [row[i].item() for i in top_ids] == pytest.approx(values, abs=2e-4)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    made = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 50))] for _ in range(4)]
    made.append(made[0] + made[1])  # shares the first's prefix, which the cache then holds
    made.append([rng.randrange(3, 512)])  # one token: nothing to score
    return made


def random_prompt_of(length: int) -> list[int]:
    rng = random.Random(length)
    return [rng.randrange(3, 512) for _ in range(length)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_prefill_token_num": 24},  # prompts prefilled in chunks, beside other rows
        {
            "cache_max_entry_count": 8,
            "session_len": 128,
            "max_prefill_token_num": 40,
        },  # preempted mid-prompt
        {  # chunked prompts scored beside decoding rows that verify n-gram proposals
            "max_prefill_token_num": 24,
            "speculative_method": "ngram",
            "num_speculative_tokens": 3,
            "ngram_min": 1,
        },
    ],
    ids=["whole", "chunked", "preempted", "speculating"],
)
def test_prompt_logprobs_equal_transformers(tiny_model_dir, backend, options, monkeypatch):
    model_dir = tiny_model_dir("llama3-rope")
    model = load_hf_model(model_dir)
    batch = prompts(len(options))
    speculating = "speculative_method" in options
    if speculating:  # repetitive prompts decode (and propose) while the long last one is scored
        batch = [[5, 6, 7] * 4, [9, 10, 11] * 3, *batch, random_prompt_of(120)]
    # Count the steps that score prompts beside rows verifying proposals.
    beside_proposals = []
    score = LLMEngine._score_prompts
    monkeypatch.setattr(
        LLMEngine,
        "_score_prompts",
        lambda self, step, logits: (
            beside_proposals.append(bool(step.proposed)) or score(self, step, logits)
        ),
    )
    scored = SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=TOP)
    plain = SamplingParams(max_tokens=24, temperature=0)
    with LLM(
        str(model_dir),
        backend=backend,
        device="cpu",
        dtype="float32",
        cache_block_seq_len=16,
        **options,
    ) as llm:
        alone = llm.generate(batch, plain)  # also fills the prefix cache
        # Every other request scores its prompt; the rest must get exactly their tokens.
        mixed = llm.generate(batch, [scored if i % 2 == 0 else plain for i in range(len(batch))])
        again = llm.generate(batch, scored)
        assert llm.engine.stats().kv_blocks_used == 0
        preemptions = llm.engine.engine.scheduler.num_preemptions
        speculator = llm.engine.engine.speculator
    if "cache_max_entry_count" in options:
        assert preemptions > 0
    if speculating:
        assert speculator.stats.accepted > 0, speculator.stats
        assert any(beside_proposals), "no step scored a prompt beside proposals"
    for i, prompt in enumerate(batch):
        want = reference(model, prompt)
        assert mixed[i].token_ids == alone[i].token_ids
        assert again[i].token_ids == alone[i].token_ids
        check(again[i].prompt_logprobs, prompt, want)
        if i % 2 == 0:
            check(mixed[i].prompt_logprobs, prompt, want)
        else:
            assert mixed[i].prompt_logprobs is None
