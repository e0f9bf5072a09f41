"""Decode steps of a backend's model runner, timed one by one (used by the CPU benchmarks
``bench_neighbour.py`` and ``bench_vs_llama_cpp.py``).

A batch of sequences is prefilled, then decoded one token per sequence per step, the way
the engine's scheduler drives a runner, without the scheduler and the sampler: each time
is one ``runner.execute`` (the model call of one engine step).
"""

from __future__ import annotations

import time
from pathlib import Path

BACKENDS = ("turbo", "torch")


def load_runner(
    backend: str,
    model_dir: Path,
    num_blocks: int,
    cpu_threads: int | None,
    quantization: str = "none",
):
    """The backend's runner on the CPU in fp32 (weights int8 with ``quantization="int8"``),
    with ``num_blocks`` KV blocks of 64 tokens."""
    from llmctl.model.config import ModelConfig

    if backend == "turbo":
        from llmctl_turbo.runner import TurboModelRunner as Runner
    else:
        from llmctl_torch.model import TorchModelRunner as Runner
    config = ModelConfig.from_dir(model_dir)
    return Runner(
        model_dir,
        config,
        dtype="float32",
        device="cpu",
        block_size=64,
        num_blocks=num_blocks,
        cpu_threads=cpu_threads,
        quantization=quantization,
    )


def blocks_needed(batch: int, max_tokens: int, block_size: int = 64) -> int:
    return batch * -(-max_tokens // block_size)


def decode_step_times(runner, batch: int, prompt_len: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``batch`` sequences after a prompt of
    ``prompt_len`` tokens (the next token fed back is the greedy one)."""
    from llmctl.engine.runner import StepBatch

    block_size = runner.block_size
    per_seq = -(-(prompt_len + steps) // block_size)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]

    times: list[float] = []

    def step(tokens: list[list[int]], start: int) -> list[int]:
        """Run every sequence's `tokens` at positions start.., timing the model call;
        return the greedy next ids."""
        ids, positions, slots = [], [], []
        for table, seq_tokens in zip(tables, tokens, strict=True):
            for offset, token in enumerate(seq_tokens):
                position = start + offset
                ids.append(token)
                positions.append(position)
                slots.append(table[position // block_size] * block_size + position % block_size)
        count = len(tokens[0])
        step_batch = StepBatch(
            input_ids=ids,
            positions=positions,
            query_lens=[count] * batch,
            context_lens=[start + count] * batch,
            block_tables=tables,
            slot_mapping=slots,
        )
        started = time.perf_counter()
        logits = runner.execute(step_batch)
        times.append(time.perf_counter() - started)
        return logits.argmax(-1).tolist()

    vocab = runner.config.vocab_size
    prompts = [[(7 * s + 3 * i) % (vocab - 3) + 3 for i in range(prompt_len)] for s in range(batch)]
    next_ids = step(prompts, 0)
    for i in range(steps):
        next_ids = step([[token] for token in next_ids], prompt_len + i)
    return times[1:]  # the decode steps, not the prefill


def prefill_seconds(runner, prompt_len: int) -> float:
    """Seconds of one prefill step of a ``prompt_len``-token prompt (one sequence)."""
    from llmctl.engine.runner import StepBatch

    block_size = runner.block_size
    vocab = runner.config.vocab_size
    positions = list(range(prompt_len))
    step_batch = StepBatch(
        input_ids=[(3 * i) % (vocab - 3) + 3 for i in positions],
        positions=positions,
        query_lens=[prompt_len],
        context_lens=[prompt_len],
        block_tables=[list(range(-(-prompt_len // block_size)))],
        slot_mapping=positions,
    )
    started = time.perf_counter()
    runner.execute(step_batch)
    return time.perf_counter() - started


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
