"""Speculative decoding on both native backends (CPU), n-gram and draft-model proposals,
on random tiny Llama, Qwen2 (q/k/v biases) and Mistral (one KV head) models: greedy
tokens equal those without speculation, token for token, for block sizes 16, 64 and 128,
with the prefix cache, and under a KV budget so small that requests preempt each other;
the KV blocks all come back. A draft model that is the target itself has every proposal
accepted; another one (same tokenizer) changes nothing of the output; one with another
tokenizer is refused, naming both vocabularies.
A verification step's logits at every position equal a plain step's (the runners'
``logits_indices``)."""

from __future__ import annotations

import random

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.runner import StepBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = ["torch", "turbo"]
KINDS = ["llama3-rope", "qwen2", "mistral-one-kv-head"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "turbo":
        from llmctl_turbo.build import load_ops

        load_ops()
    return request.param


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a phrase (prompt lookup then proposes), and some that do not."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 9))]
        prompt = phrase * rng.randrange(2, 5)
        if i % 3 == 2:
            prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))]
        prompts.append(prompt)
    prompts.append(prompts[0] + prompts[1])  # shares a prefix with the first
    return prompts


def grounded(model_dir, backend, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt, the model's greedy answer to it (8 tokens), then the prompt's last 4
    tokens again: the answer is in the prompt (what prompt lookup is for), so a random
    model, which does not copy a phrase, accepts proposals too (the engine proposes only
    where copying pays)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), backend=backend, device="cpu", dtype="float32") as llm:
        answers = [o.token_ids for o in llm.generate(prompts, params)]
    return [prompt + answer + prompt[-4:] for prompt, answer in zip(prompts, answers)]


def generate(model_dir, backend, prompts, params, **options):
    with LLM(str(model_dir), backend=backend, device="cpu", dtype="float32", **options) as llm:
        assert llm.backend == backend
        outputs = llm.generate(prompts, params)
        again = llm.generate(prompts[::-1], params)  # the prefix cache serves this round
        engine = llm.engine.engine
        assert llm.engine.stats().kv_blocks_used == 0
        stats = engine.speculator.stats if engine.speculator is not None else None
        preemptions = engine.scheduler.num_preemptions
    return [o.token_ids for o in outputs] + [o.token_ids for o in again[::-1]], stats, preemptions


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_greedy_tokens_equal_without_speculation(tiny_model_dir, backend, kind, block_size):
    model_dir = tiny_model_dir(kind)
    prompts = grounded(model_dir, backend, repetitive_prompts(block_size, 7))
    params = SamplingParams(max_tokens=40, temperature=0)
    want, _, _ = generate(model_dir, backend, prompts, params, cache_block_seq_len=block_size)
    got, stats, _ = generate(
        model_dir,
        backend,
        prompts,
        params,
        cache_block_seq_len=block_size,
        speculative_method="ngram",
        num_speculative_tokens=5,
        ngram_min=1,
    )
    assert got == want
    assert stats.accepted > 0, stats


def test_greedy_tokens_equal_under_preemption(tiny_model_dir, backend):
    model_dir = tiny_model_dir("qwen2")
    prompts = grounded(model_dir, backend, repetitive_prompts(7, 9))
    params = SamplingParams(max_tokens=48, temperature=0)
    # 8 blocks of 16 tokens: one 128-token session fits, not the whole batch.
    options = dict(cache_block_seq_len=16, cache_max_entry_count=8, session_len=128)
    want, _, _ = generate(model_dir, backend, prompts, params, **options)
    got, stats, preemptions = generate(
        model_dir, backend, prompts, params, speculative_method="ngram", ngram_min=1, **options
    )
    assert got == want
    assert preemptions > 0 and stats.accepted > 0


def test_verification_logits_equal_one_token_steps(tiny_model_dir, backend):
    """The runner's logits at every position of a 6-token chunk over a cached context
    equal those of feeding the same tokens one step at a time."""
    with LLM(
        str(tiny_model_dir("mistral-one-kv-head")),
        backend=backend,
        device="cpu",
        dtype="float32",
        cache_block_seq_len=16,
    ) as llm:
        runner = llm.engine.engine.runner
        rng = random.Random(0)
        tokens = [rng.randrange(3, 512) for _ in range(30)]
        context, chunk = 24, 6

        def step(start, count, table, indices=None):
            positions = list(range(start, start + count))
            return runner.execute(
                StepBatch(
                    input_ids=tokens[start : start + count],
                    positions=positions,
                    query_lens=[count],
                    context_lens=[start + count],
                    block_tables=[table],
                    slot_mapping=[table[p // 16] * 16 + p % 16 for p in positions],
                    logits_indices=indices,
                )
            ).clone()

        step(0, context, [0, 1])
        together = step(context, chunk, [0, 1], indices=list(range(chunk)))
        assert together.shape[0] == chunk
        step(0, context, [2, 3])
        one_by_one = torch.cat([step(context + i, 1, [2, 3]) for i in range(chunk)])
        torch.testing.assert_close(together, one_by_one, rtol=1e-4, atol=1e-4)
        # Without logits_indices: the last token's row only.
        step(0, context, [4, 5])
        last = step(context, chunk, [4, 5])
        torch.testing.assert_close(last, one_by_one[-1:], rtol=1e-4, atol=1e-4)


def test_backend_rules_take_ngram_and_refuse_what_they_cannot_do():
    from llmctl.backend import Hardware
    from llmctl.selection import installed_backends

    cpu = Hardware(cuda_available=False)
    backends = installed_backends()
    ngram = {"speculative_method": "ngram", "ngram_min": 1, "ngram_max": 4}
    for name in BACKENDS:
        rules = backends[name]
        assert rules.option_errors(ngram, cpu) == {}
        draft = rules.option_errors({"speculative_method": "draft"}, cpu)
        assert "needs speculative_model" in draft["speculative_method"]
        with_model = {"speculative_method": "draft", "speculative_model": "/m"}
        assert rules.option_errors(with_model, cpu) == {}
        sharded = rules.option_errors({**with_model, "tensor_parallel_size": 2}, cpu)
        assert "tensor_parallel_size > 1" in sharded.get("speculative_method", ""), sharded
        swapped = rules.option_errors({**ngram, "ngram_min": 5}, cpu)
        assert "ngram_min (5) must not be larger than ngram_max (4)" in swapped["ngram_min"]
        model = rules.option_errors({**ngram, "speculative_model": "/m"}, cpu)
        assert "speculative_method=draft" in model["speculative_model"]
    if "transformers" in backends:
        refused = backends["transformers"].option_errors(ngram, cpu)
        assert "no speculative decoding" in refused["speculative_method"]


@pytest.mark.parametrize(
    ("kind", "draft_kind", "block_size"),
    [("llama3-rope", "same", 16), ("qwen2", "llama-mqa", 64), ("mistral-one-kv-head", "same", 128)],
)
def test_draft_model_greedy_tokens_equal_without_speculation(
    tiny_model_dir, tmp_path, backend, kind, draft_kind, block_size
):
    from tests.helpers.tiny_models import make_tiny_model

    model_dir = tiny_model_dir(kind)
    draft = model_dir if draft_kind == "same" else make_tiny_model(tmp_path, draft_kind, seed=5)
    prompts = repetitive_prompts(block_size + 1, 7)
    params = SamplingParams(max_tokens=40, temperature=0)
    want, _, _ = generate(model_dir, backend, prompts, params, cache_block_seq_len=block_size)
    got, stats, _ = generate(
        model_dir,
        backend,
        prompts,
        params,
        cache_block_seq_len=block_size,
        speculative_method="draft",
        speculative_model=str(draft),
        num_speculative_tokens=4,
    )
    assert got == want
    assert stats.proposed > 0
    if draft_kind == "same":  # the target's own argmax: every proposal is accepted
        assert stats.accepted == stats.proposed, stats


def test_draft_model_under_preemption(tiny_model_dir, backend):
    """Preempted sequences lose their blocks, the draft's K/V with them: it starts over."""
    model_dir = tiny_model_dir("qwen2")
    prompts = repetitive_prompts(11, 9)
    params = SamplingParams(max_tokens=48, temperature=0)
    options = dict(cache_block_seq_len=16, cache_max_entry_count=8, session_len=128)
    want, _, _ = generate(model_dir, backend, prompts, params, **options)
    got, stats, preemptions = generate(
        model_dir,
        backend,
        prompts,
        params,
        speculative_method="draft",
        speculative_model=str(model_dir),
        **options,
    )
    assert got == want
    assert preemptions > 0 and stats.accepted == stats.proposed > 0


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    import shutil

    from llmctl.errors import OptionError
    from tests.helpers.trained_tokenizers import trained

    model_dir = tiny_model_dir("llama3-rope")
    draft = shutil.copytree(model_dir, tmp_path / "draft")
    other = trained("metaspace")  # a BPE of its own: 300 tokens, other ids
    other.hf_tokenizer.save(str(draft / "tokenizer.json"))
    with pytest.raises(OptionError) as refused:
        LLM(
            str(model_dir),
            backend="torch",
            device="cpu",
            speculative_method="draft",
            speculative_model=str(draft),
        )
    message = str(refused.value)
    assert "does not share the model's tokenizer" in message
    assert f"has {other.vocab_size} tokens, the model's 512" in message, message
