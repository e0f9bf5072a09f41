"""What both backends' CUDA-graph tests measure of a run: tokens, replays, preemptions."""

from __future__ import annotations

from llmctl import LLM, SamplingParams


def greedy_rounds(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], cuda_graphs: bool, rounds: int
) -> tuple[list[list[list[int]]], list[int], int]:
    """Greedy tokens of every prompt (each with its own max_tokens), ``rounds`` times over
    (later rounds hit the prefix cache); the decode steps graphs served in each round;
    the engine's count of preemptions."""
    params = [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens]
    results, replays = [], []
    engine = llm.engine.engine
    graphs = engine.runner.decode_graphs
    assert (graphs is not None) == cuda_graphs
    for _ in range(rounds):
        before = graphs.replays if graphs else 0
        results.append([o.token_ids for o in llm.generate(prompts, params)])
        replays.append((graphs.replays if graphs else 0) - before)
    return results, replays, engine.scheduler.num_preemptions
