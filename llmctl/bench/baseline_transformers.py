"""The baseline: transformers' own ``generate`` on the same prompts, in the same process.

Requests go in batches of ``batch_size`` in workload order, left-padded, greedy. A batch
generates as many tokens as its longest request asked for (``min_new_tokens`` =
``max_new_tokens``, so EOS cannot end it early); only the tokens each request asked
for count as useful, which is the figure compared with the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmctl.bench.metrics import MemoryPeak
from llmctl.bench.workload import BenchRequest, Workload
from llmctl.errors import LlmctlError

BatchCallback = Callable[[int], None]  # useful output tokens of the finished batch


def run_transformers_baseline(
    model_dir: Path,
    workload: Workload,
    memory: MemoryPeak,
    *,
    batch_size: int,
    device: str,
    dtype: str,
    warmup: BenchRequest | None = None,
    on_batch: BatchCallback | None = None,
) -> dict[str, Any]:
    """Generate ``workload`` with transformers; return figures shaped like the engine's."""
    import torch
    import transformers

    if batch_size < 1:
        raise LlmctlError(f"--baseline-batch-size must be at least 1, got {batch_size}")
    transformers.logging.set_verbosity_error()  # no per-batch generation-config chatter
    from llmctl.model.gguf import transformers_source

    source, gguf = transformers_source(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, dtype), **gguf
    ).to(device)
    model.eval()
    config = model.config
    eos = config.eos_token_id
    pad_id = config.pad_token_id
    if pad_id is None:
        pad_id = (eos[0] if isinstance(eos, list) else eos) or 0

    def generate(batch: list[BenchRequest]) -> int:
        """Run one batch; return the tokens generated per row (padding work included)."""
        longest_prompt = max(len(r.prompt_token_ids) for r in batch)
        new_tokens = max(r.output_len for r in batch)
        ids = [
            [pad_id] * (longest_prompt - len(r.prompt_token_ids)) + r.prompt_token_ids
            for r in batch
        ]
        mask = [
            [0] * (longest_prompt - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
            for r in batch
        ]
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor(ids, device=device),
                attention_mask=torch.tensor(mask, device=device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        generated = out.shape[1] - longest_prompt
        if generated != new_tokens:
            raise LlmctlError(
                f"transformers generated {generated} tokens for a batch that asked for "
                f"{new_tokens}: the baseline cannot be compared"
            )
        return generated

    if warmup is not None:
        generate([warmup])

    requests = workload.requests
    padded_tokens = 0
    with memory:
        start = time.perf_counter()
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            padded_tokens += generate(batch) * len(batch)
            if on_batch is not None:
                on_batch(sum(r.output_len for r in batch))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        duration = time.perf_counter() - start

    useful = workload.output_tokens
    prompt_tokens = workload.prompt_tokens
    return {
        "name": "transformers",
        "version": transformers.__version__,
        "batch_size": batch_size,
        "duration_s": duration,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": useful,
        "generated_tokens": padded_tokens,
        "requests_per_s": len(requests) / duration,
        "output_tokens_per_s": useful / duration,
        "total_tokens_per_s": (prompt_tokens + useful) / duration,
        "peak_memory_bytes": memory.peak_bytes,
        "memory_measure": memory.measure,
    }
