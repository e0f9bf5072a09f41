"""turbo's decode through CUDA graphs gives the same greedy tokens as eager decode and
transformers (marked ``gpu``; ``scripts/gpu_check.py`` runs them on a GPU machine).

The turbo runner captures its whole native step (``llama_step``) per batch-size bucket
(``llmctl.engine.runner.DecodeGraphs``). Batches shrink through bucket and non-bucket sizes as
requests finish; a second round starts from the prefix cache; a tight cache forces
preemption. Padding rows (context length 0, slot -1) must change nothing: the KV cache
after graph decode equals the one after eager decode.

Without a GPU there is nothing to run: turbo's CPU kernels refuse a context of length 0,
so the padded buffers cannot be replayed eagerly on the CPU (the torch backend's test
does that with its interpreted Triton kernels); the kernels' zero output for padding is
checked in the emulator (test_cuda_emulated.py).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from llmctl_turbo.runner import TurboModelRunner

from llmctl import LLM
from llmctl.model.config import ModelConfig
from tests.conftest import STORIES
from tests.helpers.cuda_graphs import greedy_rounds
from tests.helpers.tiny_models import PagedSequences, hf_greedy, load_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU"),
]
MODELS = ["stories260K", "qwen2", "mistral-one-kv-head"]
# The batch shrinks from 19 through every size down to 1 as requests finish: buckets
# (16, 8, 4, 2, 1) and sizes between them, and 17-19 in the top bucket of max 20.
MAX_BATCH = 20


@pytest.fixture
def model_dir(request, tiny_model_dir):
    kind = request.param
    if kind == "stories260K":
        if not (STORIES / "config.json").is_file():
            pytest.skip(f"stories260K fixture not found at {STORIES}")
        return STORIES
    return tiny_model_dir(kind)


def workload(seed: int) -> tuple[list[list[int]], list[int]]:
    """19 prompts of varied lengths (two share a long prefix), each generating a different
    number of tokens, so the decode batch passes through every size from 19 to 1."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(17)]
    prompts += [prompts[3] + [7, 8, 9], prompts[3][:20]]
    return prompts, [8 + i for i in range(len(prompts))]


def generate(model_dir, prompts, max_tokens, cuda_graphs: bool, rounds: int = 1, **options):
    """Greedy tokens of every prompt, ``rounds`` times over; the decode steps graphs served
    per round; the engine's preemption count."""
    with LLM(
        str(model_dir), backend="turbo", device="cuda", dtype="float32",
        cuda_graphs=cuda_graphs, max_batch_size=MAX_BATCH, cache_block_seq_len=32, **options,
    ) as llm:  # fmt: skip
        return greedy_rounds(llm, prompts, max_tokens, cuda_graphs, rounds)


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_graphs_give_eager_and_transformers_greedy_tokens(model_dir):
    prompts, max_tokens = workload(seed=len(str(model_dir)))
    reference = hf_greedy(load_hf_model(model_dir), prompts, max(max_tokens))
    expected = [ref[:n] for ref, n in zip(reference, max_tokens, strict=True)]

    (graphed, again), replays, _ = generate(model_dir, prompts, max_tokens, True, rounds=2)
    (eager,), no_replays, _ = generate(model_dir, prompts, max_tokens, False)

    assert graphed == eager == expected
    assert again == expected  # the second round starts from the prefix cache
    assert all(replays) and no_replays == [0]


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_graphs_under_preemption_keep_greedy_exact(model_dir):
    prompts, _ = workload(seed=7)
    prompts = prompts[:12]
    reference = hf_greedy(load_hf_model(model_dir), prompts, 24)
    # 5 blocks of 32 tokens: one session of 160 tokens fits, the batch does not.
    tight = dict(cache_max_entry_count=5, session_len=160)
    (graphed,), replays, preemptions = generate(model_dir, prompts, [24] * 12, True, **tight)
    (eager,), _, _ = generate(model_dir, prompts, [24] * 12, False, **tight)
    assert preemptions > 0 and all(replays)
    assert graphed == eager == reference


def decode_through_runner(model_dir, dtype: str, eager: bool, prompts, steps: int = 4):
    """Logits of each decode step (5 sequences: padded to the bucket of 8), the cache
    entries of every token the sequences hold afterwards, and the graphs' replay count."""
    config = ModelConfig.from_dir(model_dir)
    runner = TurboModelRunner(
        model_dir, config, dtype=dtype, device="cuda", block_size=32, num_blocks=64,
        max_num_seqs=8, cuda_graphs=not eager,
    )  # fmt: skip
    assert (runner.decode_graphs is None) == eager
    paged = PagedSequences(runner, seed=1)
    seqs = [paged.add(p) for p in prompts]
    logits = paged.step({s: len(p) for s, p in zip(seqs, prompts, strict=True)})
    steps_logits = []
    for _ in range(steps):
        for row, seq in enumerate(seqs):
            paged.tokens[seq].append(int(logits[row].argmax()))
        logits = paged.step({s: 1 for s in seqs})
        steps_logits.append(logits.clone())
    replays = runner.decode_graphs.replays if runner.decode_graphs else 0
    blocks = [paged.blocks[s][p // 32] for s in seqs for p in range(paged.cached[s])]
    offsets = [p % 32 for s in seqs for p in range(paged.cached[s])]
    written = runner.kv_cache[:, :, blocks, offsets]  # [layers, 2, tokens, kv_heads, D]
    return torch.stack(steps_logits), written, replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_graph_decode_matches_eager_and_writes_nothing_else(stories_dir, dtype):
    """Padding changes the matmul shapes, so logits may differ by rounding, never by more;
    the sequences' cache entries agree (the padding rows' writes went nowhere: slot -1)."""
    reference = json.loads((stories_dir / "reference_greedy.json").read_text())["results"]
    prompts = [case["prompt_ids"] for case in reference][:5]
    eager_logits, eager_kv, _ = decode_through_runner(stories_dir, dtype, True, prompts)
    graph_logits, graph_kv, replays = decode_through_runner(stories_dir, dtype, False, prompts)
    assert replays == 4
    tolerance = 1e-4 if dtype == "float32" else 0.03
    scale = eager_logits.abs().max()
    assert (graph_logits - eager_logits).abs().max() <= tolerance * scale
    torch.testing.assert_close(graph_kv, eager_kv, atol=tolerance, rtol=tolerance)
