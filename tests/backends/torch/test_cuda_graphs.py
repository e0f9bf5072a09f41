"""Decode through CUDA graphs gives the same greedy tokens as eager decode and transformers.

On a GPU the torch runner captures its decode step per batch-size bucket (see
``llmctl.engine.runner.DecodeGraphs``). The ``gpu`` tests run the whole engine with
``cuda_graphs`` on and off on three models (stories260K; a random Qwen2, which has
q/k/v biases; a random Mistral with one KV head), with batches that shrink through
bucket and non-bucket sizes as requests finish, a second round from the prefix cache,
and under preemption. ``scripts/gpu_check.py`` runs them on a GPU machine.

Without a GPU the runner's steps still run through the graphs' fixed, padded buffers,
replayed eagerly, with the Triton kernels (interpreted): decode steps, verification
steps of speculative decoding (up to k + 1 tokens per sequence), steps mixing LoRA
adapters (each token's slot in a fixed buffer; another adapter put in a slot serves the
same graphs), and a whole engine speculating with adapters. The padding must write
nothing and change nothing; every logit equals the eager step's.
(``tests/backends/test_cuda_graphs_verify.py`` runs those kinds end to end on a GPU.)
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from llmctl_torch import triton_attention  # noqa: F401  (switches the interpreter on early)
from llmctl_torch.model import TorchModelRunner

from llmctl import LLM, SamplingParams
from llmctl.engine.runner import DecodeGraphs, replay_eagerly
from llmctl.model.config import ModelConfig
from tests.conftest import STORIES
from tests.helpers.cuda_graphs import greedy_rounds
from tests.helpers.lora_adapters import ATTENTION, MLP, make_adapter
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


def graphs_over(runner: TorchModelRunner, num_speculative_tokens: int) -> DecodeGraphs:
    """The runner's graphs, captured over its cache (replayed eagerly without a GPU)."""
    graphs = DecodeGraphs(
        runner.decode_step,
        max_batch_size=runner.max_num_seqs,
        max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
        block_size=runner.block_size,
        num_blocks=runner.num_blocks,
        device=runner.device,
        num_speculative_tokens=num_speculative_tokens,
        **({} if HAS_CUDA else {"record": replay_eagerly}),
    )
    graphs.capture(progress=False)
    runner.decode_graphs = graphs
    return graphs


def small_runner(model_dir, config, **options) -> TorchModelRunner:
    return TorchModelRunner(
        model_dir, config, device="cuda" if HAS_CUDA else "cpu", block_size=16,
        num_blocks=24, max_num_seqs=4, max_model_len=48, cuda_graphs=False, **options,
    )  # fmt: skip


def verification_logits(counts: dict[int, int], proposing: set[int]) -> list[int] | None:
    """What the scheduler asks of a verification step: the logits at every token of a
    sequence verifying proposals, at the last token of every other (``None``: no
    sequence verifies, each one's last)."""
    if not proposing:
        return None
    indices, start = [], 0
    for seq, count in counts.items():
        first = start if seq in proposing else start + count - 1
        indices += range(first, start + count)
        start += count
    return indices


# Steps after the prefill: (tokens each sequence feeds, those verifying proposals). With
# k = 3 a verification graph takes up to 4 tokens per sequence: 3 sequences pad to the
# bucket of 4 (plus its spare), 2 to 2; a plain decode takes the decode graph.
VERIFY_STEPS = [
    ({0: 4, 1: 1, 2: 3}, {0, 2}),  # one sequence does not speculate
    ({0: 2, 1: 4}, {0, 1}),  # a proposal shorter than k
    ({0: 1, 1: 1, 2: 1}, set()),  # decode
    ({0: 4, 1: 4, 2: 4}, {0, 1, 2}),  # every sequence at k + 1
]


def test_verification_steps_in_graph_buffers_give_eager_logits(monkeypatch, tiny_model_dir):
    """Verification steps (the last token and up to k proposals per sequence) on the
    graphs' fixed, padded buffers, replayed eagerly (a CUDA graph where there is one):
    the eager logits at every verified position, and the same KV cache (the padding
    wrote nothing)."""
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "triton")
    model_dir = tiny_model_dir("mistral-one-kv-head")
    config = ModelConfig.from_dir(model_dir)
    rng = random.Random(5)
    tokens = [[rng.randrange(3, 500) for _ in range(30)] for _ in range(3)]
    prompt_lens = {0: 12, 1: 7, 2: 20}
    runners = {eager: small_runner(model_dir, config) for eager in (True, False)}
    graphs = graphs_over(runners[False], num_speculative_tokens=3)
    logits = {}
    for eager, runner in runners.items():
        paged = PagedSequences(runner, seed=2)
        for t in tokens:
            paged.add(t)
        paged.step(prompt_lens)  # longer than k + 1: eager on both
        logits[eager] = [
            paged.step(counts, verification_logits(counts, proposing)).clone()
            for counts, proposing in VERIFY_STEPS
        ]
    for graphed, eager in zip(logits[False], logits[True]):
        assert graphed.shape == eager.shape
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    for eager_kv, graphed_kv in zip(runners[True].kv_caches, runners[False].kv_caches):
        torch.testing.assert_close(graphed_kv, eager_kv, rtol=1e-5, atol=1e-5)
    assert (graphs.replays, graphs.verify_replays, graphs.lora_replays) == (4, 3, 0)


def random_adapter(config: ModelConfig, rank: int, seed: int) -> dict:
    """LoRA weights as ``read_lora`` returns them (A, B scaled), on every module of every
    layer, large enough to change the logits clearly."""
    g = torch.Generator().manual_seed(seed)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }  # fmt: skip
    return {
        f"model.layers.{layer}.{module}": (
            0.3 * torch.randn(rank, fan_in, generator=g),
            0.3 * torch.randn(fan_out, rank, generator=g),
        )
        for layer in range(config.num_layers)
        for module, (fan_in, fan_out) in shapes.items()
    }


# (tokens each sequence feeds, those verifying, each sequence's slot); before the last
# step slot 0 gets another adapter, which the graphs captured before must serve.
LORA_STEPS = [
    ({0: 1, 1: 1, 2: 1}, set(), [0, -1, 1]),  # decode, mixed: captures the LoRA graphs
    ({0: 3, 1: 1, 2: 2}, {0, 2}, [1, 0, -1]),  # verification, mixed
    ({0: 1, 1: 1, 2: 1}, set(), [-1, -1, -1]),  # base rows only: the plain decode graph
    ({0: 1, 1: 1}, set(), [0, 0]),  # after slot 0 changed adapter
]


def test_adapter_steps_in_graph_buffers_give_eager_logits(monkeypatch, tiny_model_dir):
    """Steps mixing LoRA adapters and base rows on the graphs' fixed buffers (each
    token's slot in one of them): the first such step captures the graphs with LoRA
    slots; every step gives the eager logits; another adapter put in a slot afterwards
    serves the same graphs; rows without an adapter equal the base model's."""
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "triton")
    model_dir = tiny_model_dir("mistral-one-kv-head")
    config = ModelConfig.from_dir(model_dir)
    rng = random.Random(6)
    tokens = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(3)]
    adapters = [random_adapter(config, rank, seed) for rank, seed in ((4, 1), (8, 2), (2, 3))]
    runners = {name: small_runner(model_dir, config, max_loras=2, max_lora_rank=8)
               for name in ("eager", "graphed", "base")}  # fmt: skip
    graphs = graphs_over(runners["graphed"], num_speculative_tokens=2)
    logits = {}
    for name, runner in runners.items():
        if name != "base":
            runner.load_lora_slot(0, adapters[0])
            runner.load_lora_slot(1, adapters[1])
        paged = PagedSequences(runner, seed=3)
        for t in tokens:
            paged.add(t)
        paged.step({0: 9, 1: 5, 2: 11}, lora_slots=None if name == "base" else [0, -1, 1])
        logits[name] = []
        for index, (counts, proposing, slots) in enumerate(LORA_STEPS):
            if index == len(LORA_STEPS) - 1 and name != "base":
                runner.load_lora_slot(0, adapters[2])
            wanted = verification_logits(counts, proposing)
            adapters_used = None if name == "base" or max(slots) < 0 else slots
            logits[name].append(paged.step(counts, wanted, adapters_used).clone())
        assert (runner.decode_graphs is not None) == (name == "graphed")
    assert graphs.lora_captured
    for graphed, eager in zip(logits["graphed"], logits["eager"]):
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert (graphs.replays, graphs.verify_replays, graphs.lora_replays) == (4, 1, 3)
    # The adapters change what they touch, and only that: in the first step, the base
    # row (1) is the base model's, the others are not.
    first, base = logits["graphed"][0], logits["base"][0]
    torch.testing.assert_close(first[1], base[1], rtol=1e-4, atol=1e-4)
    assert (first[[0, 2]] - base[[0, 2]]).abs().max() > 0.1


def test_an_engine_speculating_with_adapters_gets_the_same_tokens_through_graphs(
    monkeypatch, tiny_model_dir, tmp_path
):
    """The whole engine (its scheduler's verification steps, adapters swapping through
    one slot) on the graphs' buffers, replayed eagerly without a GPU: the greedy tokens
    of the same engine without graphs."""
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "triton")
    model_dir = tiny_model_dir("qwen2")
    paths = {}
    for seed, (name, rank, modules) in enumerate([("a4", 4, ATTENTION), ("m2", 2, MLP)]):
        make_adapter(tmp_path / name, model_dir, rank=rank, target_modules=modules, seed=seed)
        paths[name] = str(tmp_path / name)
    phrase = [17, 301, 44, 9, 250]
    prompts = [phrase * 3, [5, 6, 7] + phrase * 2, phrase * 2 + [99]]
    names = [None, "a4", "m2"]
    batch = [p for p in prompts for _ in names]
    loras = [n for _ in prompts for n in names]
    params = SamplingParams(max_tokens=10, temperature=0)
    results, served = [], None
    for graphed in (False, True):
        with LLM(
            str(model_dir), backend="torch", device="cuda" if HAS_CUDA else "cpu",
            dtype="float32", lora=paths, max_loras=1, cache_block_seq_len=16, max_batch_size=4,
            session_len=64, speculative_method="ngram", num_speculative_tokens=3, ngram_min=1,
            cuda_graphs=graphed,
        ) as llm:  # fmt: skip
            runner = llm.engine.engine.runner
            if graphed and not HAS_CUDA:  # on a GPU the engine captured them itself
                graphs_over(runner, num_speculative_tokens=3)
            graphs = runner.decode_graphs
            results.append([o.token_ids for o in llm.generate(batch, params, lora=loras)])
            if graphs is not None:
                served = (graphs.replays, graphs.verify_replays, graphs.lora_replays)
            stats = llm.engine.engine.speculator.stats
    assert results[1] == results[0]
    assert stats.accepted > 0
    steps, verify_steps, lora_steps = served
    assert verify_steps > 0 and lora_steps > 0 and steps > verify_steps


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
