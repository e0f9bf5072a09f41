"""The native step (one C++ call per scheduler step) against transformers' logits.

Sequences are driven the way the engine drives them (shuffled physical blocks, a
prompt split into chunks, prefill and decode in one step), and every returned row is
compared with transformers' logits at the same position of the full sequence.
"""

from __future__ import annotations

import pytest
import torch
from llmctl_turbo.plugin import LLAMA_FAMILY
from llmctl_turbo.runner import TurboModelRunner

from llmctl.model.config import ModelConfig
from tests.helpers.tiny_models import TINY_MODELS, PagedSequences
from tests.helpers.turbo_step import check_against_transformers, hf_logits

# The tiny models turbo serves: its architectures, without MLP biases (its model rule).
TURBO_KINDS = sorted(
    kind
    for kind, (config_class, overrides) in TINY_MODELS.items()
    if config_class.replace("Config", "ForCausalLM") in LLAMA_FAMILY
    and not overrides.get("mlp_bias")
)


@pytest.mark.parametrize("block_size", [16, 48])
def test_stories260k_logits_match_transformers(turbo_ops, stories_dir, block_size):
    check_against_transformers(stories_dir, block_size)


@pytest.mark.parametrize("kind", TURBO_KINDS)
def test_tiny_model_logits_match_transformers(turbo_ops, tiny_model_dir, kind):
    check_against_transformers(tiny_model_dir(kind), block_size=32)


def test_step_refuses_inconsistent_batch(turbo_ops, stories_dir):
    from llmctl.engine.runner import StepBatch

    runner = TurboModelRunner(
        stories_dir, ModelConfig.from_dir(stories_dir), block_size=16, num_blocks=4
    )
    bad = StepBatch(
        input_ids=[5, 6],
        positions=[0, 1],
        query_lens=[2],
        context_lens=[2],
        block_tables=[[7]],
        slot_mapping=[0, 1],
    )
    with pytest.raises(RuntimeError, match=r"block_tables\[0\]\[0\] = 7 is outside"):
        runner.execute(bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_greedy_step_hands_back_the_argmax_of_its_logits(turbo_ops, stories_dir, dtype):
    """execute_greedy: the logits of a plain execute (a twin runner over the same blocks)
    and each row's torch.argmax of them, over prefill chunks, decodes and a speculative
    step's logits indices. fp16 goes through ATen's matmul, the others find the argmax in
    the LM head."""
    config = ModelConfig.from_dir(stories_dir)
    drivers = [
        PagedSequences(
            TurboModelRunner(stories_dir, config, dtype=dtype, block_size=16, num_blocks=16),
            seed=5,
        )
        for _ in range(2)
    ]
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=generator) for n in (20, 7, 33)]
    for driver in drivers:
        for prompt in prompts:
            driver.add(prompt.tolist())
    steps = [({0: 12, 1: 7, 2: 20}, None), ({0: 9, 1: 1, 2: 14}, None), ({0: 1, 2: 1}, None)]
    steps.append(({0: 1, 1: 2, 2: 1}, [0, 1, 3]))  # a speculative step's rows
    for counts, logits_indices in steps:
        logits, ids = drivers[0].step(counts, logits_indices, greedy=True)
        plain = drivers[1].step(counts, logits_indices)
        assert torch.equal(logits, plain)
        assert ids.dtype == torch.int64 and torch.equal(ids, logits.argmax(dim=1))
        fed = torch.randint(3, config.vocab_size, (3,), generator=generator).tolist()
        for driver in drivers:  # every sequence decodes on: one more token to feed each
            for seq, token in enumerate(fed):
                driver.tokens[seq].append(token)


@pytest.mark.parametrize("dtype,atol", [("bfloat16", 0.5), ("float16", 0.06)])
def test_half_precision_step_stays_close_to_fp32_transformers(turbo_ops, stories_dir, dtype, atol):
    """bf16 / fp16 weights, cache and kernels: logits within the dtype's rounding."""
    config = ModelConfig.from_dir(stories_dir)
    runner = TurboModelRunner(stories_dir, config, dtype=dtype, block_size=16, num_blocks=8)
    tokens = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    expected = hf_logits(stories_dir, tokens.tolist())
    driver = PagedSequences(runner, seed=2)
    seq = driver.add(tokens.tolist())
    for count in (25, 15):  # a chunked prefill
        logits = driver.step({seq: count})[0]
        torch.testing.assert_close(logits, expected[driver.cached[seq] - 1], atol=atol, rtol=0)
