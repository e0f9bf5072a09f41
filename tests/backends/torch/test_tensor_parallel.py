"""Tensor parallelism on CPU (gloo): the model sharded over two ranks, rank 1 in a process
llmctl starts, gives transformers' greedy tokens, and the rule refuses what cannot shard.

Every engine here starts a worker process (it imports torch: seconds), so each test
builds one engine and puts many requests, prefix reuse and cache pressure through it.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from llmctl_torch.config import tensor_parallel_problem
from llmctl_torch.distributed import Topology
from llmctl_torch.model import TorchModelRunner
from llmctl_torch.tp_runner import TensorParallelRunner, WorkerTask, with_host_tokens

from llmctl import LLM, SamplingParams
from llmctl.engine.runner import SampledTokenFill, StepBatch
from llmctl.model.config import ModelConfig
from tests.conftest import STORIES
from tests.helpers.tiny_models import (
    PagedSequences,
    hf_greedy,
    load_hf_model,
    make_tiny_model,
)

NEW_TOKENS = 24


def open_llm(model_dir, **options) -> LLM:
    return LLM(
        str(model_dir),
        backend="torch",
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        **options,
    )


@pytest.fixture(scope="module")
def stories_case():
    """The stored reference continuations, plus prompts sharing long prefixes (for the
    prefix cache) continued by transformers here."""
    if not (STORIES / "reference_greedy.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    reference = json.loads((STORIES / "reference_greedy.json").read_text())
    prompts = [r["prompt_ids"] for r in reference["results"]]
    expected = [r["new_token_ids"] for r in reference["results"]]
    story = prompts[0] + expected[0]
    extra = [story[:40], story[:40] + [286, 261], story[:75], story[:9], story[:70] + [317]]
    return prompts + extra, expected + hf_greedy(load_hf_model(STORIES), extra, 48)


def test_stories260k_sharded_greedy_equals_transformers(stories_case):
    """8 heads and 4 KV heads over 2 ranks. Every request in flight at once in a cache
    too small for all (preemption), prompts prefilled in chunks beside decodes, then
    again in reverse, reusing the prefix cache."""
    prompts, expected = stories_case
    greedy = SamplingParams(max_tokens=48, temperature=0)
    # 24 blocks of 16 tokens: the longest request (75 + 48 tokens) fits, not all of them.
    options = dict(cache_max_entry_count=24, session_len=160, max_prefill_token_num=64)
    with open_llm(STORIES, cache_block_seq_len=16, **options) as llm:
        assert llm.engine.stats().tensor_parallel_size == 2
        first = llm.generate(prompts, greedy)
        again = llm.generate(prompts[::-1], greedy)
        stats = llm.engine.stats()
        cached = len(llm.engine.engine.block_manager._cached)  # prefixes kept for reuse
        preemptions = llm.engine.engine.scheduler.num_preemptions
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected[::-1]
    assert stats.kv_blocks_used == 0 and cached > 0 and preemptions > 0


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama-mqa", {"vocab_size": 515}),  # one KV head, replicated; vocab padded per rank
        ("qwen2", {}),  # q/k/v biases, untied LM head
        # o and down biases: row-parallel, added once after the all-reduce
        ("llama-attention-bias", {"mlp_bias": True}),
        pytest.param(
            "qwen3",
            {"num_attention_heads": 8, "num_key_value_heads": 4},  # q/k norms
            marks=pytest.mark.slow,
        ),
    ],
)
def test_tiny_models_sharded_greedy_equal_transformers(tmp_path, kind, overrides):
    model_dir = make_tiny_model(tmp_path, kind, **overrides)
    rng = random.Random(kind)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 23, 40, 70)]
    prompts.append(prompts[3] + [rng.randrange(3, 500) for _ in range(5)])  # shared prefix
    expected = hf_greedy(load_hf_model(model_dir), prompts, NEW_TOKENS)
    with open_llm(model_dir, cache_block_seq_len=16, max_prefill_token_num=64) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize(
    "quantized, tolerance",
    [
        (dict(), 1e-6),
        # Row-parallel layers quantize each rank's input columns with their own scales,
        # so a shard's int8 rounding differs a little from the whole weight's (measured:
        # 1.8 % of the largest logit).
        (dict(quantization="int8", kv_cache_dtype="int8"), 4e-2),
    ],
    ids=["fp32", "int8"],
)
def test_sharded_logits_match_one_device(tmp_path, quantized, tolerance):
    """The runner's logits at tp 2 against tp 1 on the same steps (prefill and decode),
    in the model dtype and with int8 weights and KV cache on every rank."""
    model_dir = make_tiny_model(tmp_path, "qwen2", num_key_value_heads=1)
    config = ModelConfig.from_dir(model_dir)
    topology = Topology(2, 1, 0, "127.0.0.1", None, "cpu")
    single = TorchModelRunner(model_dir, config, block_size=16, num_blocks=32, **quantized)
    task = WorkerTask(str(model_dir), torch.float32, 16, **quantized)
    sharded = TensorParallelRunner(task, config, topology, torch.device("cpu"))
    try:
        sharded.allocate_kv_cache(32)
        rng = random.Random(0)
        drivers = [PagedSequences(single), PagedSequences(sharded)]
        for driver in drivers:
            for length in (5, 30, 17):
                driver.add([rng.randrange(3, 500) for _ in range(length)])
            rng.seed(0)  # the same prompts for both
        # A prefill, a chunk beside it, then one decode token each (the prompts' last).
        steps = [{0: 4, 1: 20, 2: 10}, {1: 9, 2: 6}, {0: 1, 1: 1, 2: 1}]
        for step in steps:
            expected, got = (driver.step(step) for driver in drivers)
            scale = expected.abs().max().item()
            torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * scale)
    finally:
        sharded.close()


@pytest.mark.parametrize(
    "tp, heads, kv_heads, mlp, fits",
    [
        (2, 8, 4, 172, True),  # stories260K
        (4, 8, 4, 172, True),
        (3, 8, 4, 172, False),  # heads
        (2, 4, 1, 96, True),  # one KV head, replicated
        (4, 8, 2, 96, True),  # 2 KV heads over 4 ranks: each on 2
        (4, 12, 3, 96, False),  # 3 KV heads cannot be spread over 4 ranks
        (2, 8, 4, 171, False),  # MLP
    ],
)
def test_the_sharding_rule(tp, heads, kv_heads, mlp, fits):
    problem = tensor_parallel_problem(tp, heads, kv_heads, mlp)
    assert (problem is None) == fits
    if not fits:
        assert f"tensor_parallel_size {tp}" in problem and "use 1" in problem


def test_tokens_still_on_the_device_reach_the_other_ranks():
    """Overlapped steps leave the tokens sampled by the step before on rank 0's device;
    the batch the other ranks get carries them."""
    batch = StepBatch(
        input_ids=np.array([5, 0, 7, 0], dtype=np.int32),
        positions=[3, 9, 4, 2],
        query_lens=[1, 1, 1, 1],
        context_lens=[4, 10, 5, 3],
        block_tables=[[0], [1], [2], [3]],
        slot_mapping=[3, 25, 36, 50],
        sampled_tokens=SampledTokenFill(torch.tensor([1, 3]), torch.tensor([42, 43])),
    )
    resolved = with_host_tokens(batch)
    assert resolved.sampled_tokens is None
    assert resolved.input_ids.tolist() == [5, 42, 7, 43]
    assert batch.input_ids.tolist() == [5, 0, 7, 0]  # the engine's own buffer is untouched
    # A steady decode's: every token, in order, with no indices.
    whole = replace(batch, sampled_tokens=SampledTokenFill(None, torch.tensor([8, 6, 4, 2])))
    assert with_host_tokens(whole).input_ids.tolist() == [8, 6, 4, 2]


def test_a_dropped_sharded_llm_releases_its_ranks_for_the_next():
    """``del llm`` without ``shutdown()``: the finalizer stops the ranks and leaves the
    process group, so a second sharded LLM in this process starts."""
    import gc

    import torch.distributed as dist

    llm = open_llm("demo")
    worker = next(iter(llm.engine.engine.runner.ranks.workers.values()))
    del llm
    gc.collect()
    assert not dist.is_initialized() and not worker.is_alive()
    with open_llm("demo") as again:
        assert len(again.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids) == 3
    assert not dist.is_initialized()


def test_sharded_lora_adapters_match_peft(tmp_path):
    """Two adapters (attention only; every module, rsLoRA) and the base model in one
    batch at tp 2 give transformers + peft's greedy tokens: each rank holds its slice of
    A or B, the row-parallel partial products meet in the layers' all-reduce. Two KV
    heads over two ranks, and one slot: the adapters swap in on every rank."""
    from tests.helpers.lora_adapters import ATTENTION, MLP, make_adapter

    model_dir = make_tiny_model(tmp_path / "model", "llama3-rope")
    prompts = [[5, 77, 301, 42, 9, 250, 13], [30, 31, 32], [404, 88, 61, 7, 199, 23]]
    adapters = {"attn": (8, ATTENTION, False), "all": (4, ATTENTION + MLP, True)}
    paths, want = {}, {None: hf_greedy(load_hf_model(model_dir), prompts, 10)}
    for seed, (name, (rank, modules, rslora)) in enumerate(adapters.items()):
        paths[name] = str(tmp_path / name)
        peft_model = make_adapter(
            tmp_path / name, model_dir, rank=rank, target_modules=modules, use_rslora=rslora,
            seed=seed,
        )  # fmt: skip
        want[name] = hf_greedy(peft_model, prompts, 10)
        assert want[name] != want[None]
    names = [None, "attn", "all"]
    with open_llm(model_dir, lora=paths, max_loras=1, cache_block_seq_len=16) as llm:
        outputs = llm.generate(
            [p for _ in names for p in prompts],
            SamplingParams(max_tokens=10, temperature=0),
            lora=[n for n in names for _ in prompts],
        )
    got = [o.token_ids for o in outputs]
    for index, name in enumerate(names):
        assert got[index * len(prompts) : (index + 1) * len(prompts)] == want[name], name
