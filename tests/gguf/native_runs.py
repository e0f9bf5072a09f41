"""Runs of one model on turbo's runner, for comparing ``quantization=gguf`` with the same
file dequantized: every position's logits of a text, and free-running greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from llmctl.engine.runner import StepBatch
from llmctl.model.config import ModelConfig

BLOCK = 64


def turbo_runner(
    path: Path, quantization: str, tokens: int, dtype: str = "float32", device: str = "cpu"
):
    from llmctl_turbo.runner import TurboModelRunner

    return TurboModelRunner(
        path,
        ModelConfig.from_dir(path),
        dtype=dtype,
        device=device,
        block_size=BLOCK,
        num_blocks=-(-tokens // BLOCK),
        quantization=quantization,
    )


def _batch(ids: list[int], start: int, all_logits: bool) -> StepBatch:
    positions = list(range(start, start + len(ids)))
    return StepBatch(
        input_ids=ids,
        positions=positions,
        query_lens=[len(ids)],
        context_lens=[start + len(ids)],
        block_tables=[list(range(-(-(start + len(ids)) // BLOCK)))],
        slot_mapping=positions,
        logits_indices=list(range(len(ids))) if all_logits else None,
    )


def prompt_logits(runner, ids: list[int]) -> torch.Tensor:
    """float64 [len(ids), vocab]: the logits after each token of ``ids`` (one prefill)."""
    return runner.execute(_batch(ids, 0, all_logits=True)).double()


def greedy(runner, prompt: list[int], steps: int) -> list[int]:
    """``steps`` free-running greedy tokens after ``prompt``."""
    next_id = int(runner.execute(_batch(prompt, 0, all_logits=False)).argmax(-1)[0])
    out = [next_id]
    for i in range(steps - 1):
        logits = runner.execute(_batch([next_id], len(prompt) + i, all_logits=False))
        next_id = int(logits.argmax(-1)[0])
        out.append(next_id)
    return out
