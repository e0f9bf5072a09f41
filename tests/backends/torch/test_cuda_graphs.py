"""Decode through CUDA graphs gives the same greedy tokens as eager decode and transformers.

On a GPU the torch runner captures its decode step per batch-size bucket (see
``llmctl.engine.runner.DecodeGraphs``). The ``gpu`` tests run the whole engine with
``cuda_graphs`` on and off on three models (stories260K; a random Qwen2, which has
q/k/v biases; a random Mistral with one KV head), with batches that shrink through
bucket and non-bucket sizes as requests finish, a second round from the prefix cache,
and under preemption. ``scripts/gpu_check.py`` runs them on a GPU machine.

Without a GPU one test still runs the runner's decode through the graphs' fixed,
padded buffers, replayed eagerly, with the Triton kernels (interpreted): the padding
rows must write nothing and change nothing.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from llmctl_torch import triton_attention  # noqa: F401  (switches the interpreter on early)
from llmctl_torch.model import TorchModelRunner

from llmctl import LLM
from llmctl.engine.runner import DecodeGraphs, replay_eagerly
from llmctl.model.config import ModelConfig
from tests.conftest import STORIES
from tests.helpers.cuda_graphs import greedy_rounds
from tests.helpers.tiny_models import PagedSequences, greedy, hf_greedy, load_hf_model

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need an NVIDIA GPU")
# The batch shrinks from 19 through every size down to 1 as requests finish: buckets
# (16, 8, 4, 2, 1) and sizes between them, and 17-19 in the top bucket of max 20.
MAX_BATCH = 20
NUM_PROMPTS = 19


def test_padded_decode_buffers_give_eager_tokens(monkeypatch, tiny_model_dir):
    """The runner's decode on the graphs' fixed buffers, padded 3 -> 4 and 2 -> 2, replayed
    eagerly (a CUDA graph where there is one): the same tokens and the same KV cache as
    plain eager decode."""
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "triton")
    model_dir = tiny_model_dir("mistral-one-kv-head")
    config = ModelConfig.from_dir(model_dir)
    device = "cuda" if HAS_CUDA else "cpu"
    prompts = [[5, 17, 300, 41], [9, 2, 77], list(range(20, 39))]

    def runner(eager: bool) -> TorchModelRunner:
        return TorchModelRunner(
            model_dir, config, device=device, block_size=16, num_blocks=24,
            max_num_seqs=4, max_model_len=48, cuda_graphs=not eager,
        )  # fmt: skip

    eager_runner = runner(eager=True)
    eager = greedy(eager_runner, prompts, steps=6)
    graphed = runner(eager=True)
    graphs = DecodeGraphs(
        graphed.decode_step,
        max_batch_size=4,
        max_blocks_per_seq=3,
        block_size=16,
        num_blocks=24,
        device=torch.device(device),
        **({} if HAS_CUDA else {"record": replay_eagerly}),
    )
    graphs.capture(progress=False)
    graphed.decode_graphs = graphs
    assert greedy(graphed, prompts, steps=6) == eager
    # The same blocks got the same tokens: the caches agree everywhere, so the padding
    # rows wrote nothing.
    for eager_kv, graphed_kv in zip(eager_runner.kv_caches, graphed.kv_caches):
        torch.testing.assert_close(graphed_kv, eager_kv, rtol=1e-5, atol=1e-5)
    assert greedy(graphed, prompts[:2], steps=3) == [t[:3] for t in eager[:2]]
    assert graphs.replays == 5 + 2


# ------------------------------------------------------------------------- on a GPU


def open_llm(model_dir, cuda_graphs: bool, **options) -> LLM:
    return LLM(
        str(model_dir),
        backend="torch",
        device="cuda",
        dtype="float32",
        cuda_graphs=cuda_graphs,
        max_batch_size=MAX_BATCH,
        cache_block_seq_len=16,
        **options,
    )


def generate(model_dir, prompts, max_tokens, cuda_graphs: bool, rounds: int = 1, **options):
    """Greedy tokens of every prompt (each with its own max_tokens), ``rounds`` times over
    (later rounds hit the prefix cache); the decode steps graphs served in each round;
    the engine's count of preemptions."""
    with open_llm(model_dir, cuda_graphs, **options) as llm:
        return greedy_rounds(llm, prompts, max_tokens, cuda_graphs, rounds)


def model_for(kind: str, tiny_model_dir):
    if kind != "stories260K":
        return tiny_model_dir(kind)
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES}")
    return STORIES


def workload(seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of varied lengths (two share a long prefix) with staggered lengths to
    generate, so the decode batch passes through every size from 19 to 1."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(17)]
    prompts += [prompts[3] + [7, 8, 9], prompts[3][:20]]
    max_tokens = [8 + i for i in range(NUM_PROMPTS)]
    return prompts, max_tokens


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["stories260K", "qwen2", "mistral-one-kv-head"])
def test_graphs_give_eager_and_transformers_greedy_tokens(tiny_model_dir, kind):
    model_dir = model_for(kind, tiny_model_dir)
    prompts, max_tokens = workload(seed=len(kind))
    reference = hf_greedy(load_hf_model(model_dir), prompts, max(max_tokens))
    expected = [ref[:n] for ref, n in zip(reference, max_tokens)]

    (graphed, again), replays, _ = generate(model_dir, prompts, max_tokens, True, rounds=2)
    (eager,), no_replays, _ = generate(model_dir, prompts, max_tokens, False)

    assert graphed == eager == expected
    assert again == expected  # the second round starts from the prefix cache
    assert all(replays) and no_replays == [0]  # graphs served decode steps in both rounds


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["stories260K", "qwen2", "mistral-one-kv-head"])
def test_graphs_under_preemption_keep_greedy_exact(tiny_model_dir, kind):
    model_dir = model_for(kind, tiny_model_dir)
    prompts, max_tokens = workload(seed=7)
    prompts, max_tokens = prompts[:12], [24] * 12
    reference = hf_greedy(load_hf_model(model_dir), prompts, 24)
    # 9 blocks of 16 tokens: one session of 144 tokens fits, the batch does not.
    tight = dict(cache_max_entry_count=9, session_len=144)
    (graphed,), replays, preemptions = generate(model_dir, prompts, max_tokens, True, **tight)
    (eager,), _, _ = generate(model_dir, prompts, max_tokens, False, **tight)
    assert preemptions > 0 and all(replays)
    assert graphed == eager == reference


@pytest.mark.gpu
@needs_cuda
def test_bf16_graph_logits_stay_close_to_eager(stories_dir):
    """bf16 on the GPU: padding changes the matmul shapes, so logits may differ by
    rounding, never by more."""
    config = ModelConfig.from_dir(stories_dir)
    reference = json.loads((stories_dir / "reference_greedy.json").read_text())["results"]
    prompts = [case["prompt_ids"] for case in reference][:5]  # 5 rows: padded to 8
    logits = {}
    for eager in (True, False):
        runner = TorchModelRunner(
            stories_dir, config, dtype="bfloat16", device="cuda", block_size=16,
            num_blocks=64, max_num_seqs=8, cuda_graphs=not eager,
        )  # fmt: skip
        paged = PagedSequences(runner, seed=1)
        seqs = [paged.add(p) for p in prompts]
        paged.step({s: len(p) for s, p in zip(seqs, prompts)})
        logits[eager] = paged.step({s: 1 for s in seqs}).clone()
        assert (runner.decode_graphs is None) == eager
    scale = logits[True].abs().max()
    assert (logits[False] - logits[True]).abs().max() < 0.03 * scale
