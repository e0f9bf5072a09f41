"""Offline throughput: every request of the workload submitted at once to an Engine,
optionally followed by the transformers baseline on the same prompts.

Requests are greedy with ``ignore_eos``, so each produces exactly the tokens it asked
for. The peak of KV blocks in use is the block manager's own high-water mark (reset
after the warm-up), so no short peak is missed; a ``MemoryPeak`` records the process's
peak memory.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmctl.backend import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    capabilities,
)
from llmctl.bench.metrics import (
    MemoryPeak,
    summarize,
)
from llmctl.bench.workload import (
    BenchRequest,
    LengthRange,
    Workload,
    make_workload,
    ordinary_token_ids,
)
from llmctl.engine.assemble import engine_dtype
from llmctl.errors import LlmctlError, OptionError
from llmctl.hardware import Hardware
from llmctl.model.config import ModelConfig

if TYPE_CHECKING:
    from rich.progress import Progress

ProgressCallback = Callable[[int], None]  # called with each batch of new output tokens


async def run_engine_throughput(
    engine: Engine,
    workload: Workload,
    memory: MemoryPeak,
    *,
    warmup: BenchRequest | None = None,
    on_progress: ProgressCallback | None = None,
    step_profile: bool = False,
) -> dict[str, Any]:
    """Run ``workload`` through ``engine``; return the measured figures (see docs).

    ``step_profile`` adds where the engine's steps spent their time (an engine that
    keeps a ``step_profile``: the local ones)."""
    if workload.longest_request > engine.max_model_len:
        raise LlmctlError(
            f"the workload's longest request needs {workload.longest_request} tokens but the "
            f"engine's session_len is {engine.max_model_len}: lower --input-len/--output-len "
            "or raise --session-len"
        )
    if warmup is not None:  # first steps pay one-off costs (allocation, kernel compilation)
        await _generate(engine, [("bench-warmup", warmup)], time.perf_counter(), None)
    offers = capabilities(engine)
    if offers.has_step_loop:
        offers.reset_peak_kv_blocks()  # the warm-up's blocks are not the workload's
    profiled = step_profile and offers.has_step_loop
    if profiled:
        offers.step_profile(reset=True)

    requests = [(f"bench-{i}", request) for i, request in enumerate(workload.requests)]
    with memory:
        start = time.perf_counter()
        results = await _generate(engine, requests, start, on_progress)
        duration = time.perf_counter() - start

    stats = engine.stats()
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    output_tokens = sum(r["output_tokens"] for r in results)
    result = {
        "duration_s": duration,
        "num_requests": len(results),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(results) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summarize([r["ttft_s"] * 1000.0 for r in results]),
        "peak_kv_blocks_used": stats.kv_blocks_peak,
        "kv_blocks_total": stats.kv_blocks_total,
        "block_size": stats.block_size,
        "peak_memory_bytes": memory.peak_bytes,
        "memory_measure": memory.measure,
    }
    if step_profile:
        result["step_profile"] = offers.step_profile().report() if profiled else None
    return result


# Outputs (for the progress bar) every this many tokens, besides the first token (its
# time) and the last: the engine then builds no output per token, as for LLM.generate.
PROGRESS_INTERVAL = 16


async def _generate(
    engine: Engine,
    requests: list[tuple[str, BenchRequest]],
    start: float,
    on_progress: ProgressCallback | None,
) -> list[dict[str, Any]]:
    """Run ``requests`` at once; the figures of each. A local engine takes them all in one
    ``generate_all`` call (as ``LLM.generate`` does), any other one request at a time."""
    generations = [
        GenerationRequest(
            request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=SamplingParams(
                max_tokens=request.output_len, temperature=0.0, ignore_eos=True
            ),
            stream_interval=PROGRESS_INTERVAL,
        )
        for request_id, request in requests
    ]
    first_token_at: dict[str, float] = {}
    tokens: dict[str, int] = {}

    def record(outputs: list[GenerationOutput]) -> None:
        now = time.perf_counter()
        new_tokens = 0
        for output in outputs:
            if output.token_ids:
                first_token_at.setdefault(output.request_id, now)
                new_tokens += len(output.token_ids)
                tokens[output.request_id] = tokens.get(output.request_id, 0) + len(output.token_ids)
        if on_progress is not None and new_tokens:
            on_progress(new_tokens)

    if capabilities(engine).can_generate_all:
        await asyncio.to_thread(capabilities(engine).generate_all, generations, record)
    else:

        async def one(generation: GenerationRequest) -> None:
            async for output in engine.generate(generation):
                record([output])

        await asyncio.gather(*(one(generation) for generation in generations))
    results = []
    for request_id, request in requests:
        produced = tokens.get(request_id, 0)
        if produced != request.output_len:
            raise LlmctlError(
                f"request {request_id} produced {produced} tokens but asked for "
                f"{request.output_len} with ignore_eos: the engine stopped early, so its "
                "throughput cannot be compared"
            )
        results.append(
            {
                "prompt_tokens": len(request.prompt_token_ids),
                "output_tokens": produced,
                "ttft_s": first_token_at.get(request_id, time.perf_counter()) - start,
            }
        )
    return results


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int
    input_len: LengthRange
    output_len: LengthRange
    seed: int


def workload_for(model: ModelInfo, spec: WorkloadSpec) -> Workload:
    """The seeded workload ``spec`` describes, with prompts from ``model``'s vocabulary."""
    token_ids = ordinary_token_ids(model.path, model.config)
    return make_workload(token_ids, spec.num_prompts, spec.input_len, spec.output_len, spec.seed)


def _warmup_request(model: ModelInfo, seed: int) -> BenchRequest:
    """A short request from another seed, so it shares no prefix with the workload."""
    token_ids = ordinary_token_ids(model.path, model.config)
    return make_workload(token_ids, 1, LengthRange(16, 16), LengthRange(8, 8), seed + 1).requests[0]


def benchmark_throughput(
    model: str | None,
    flags: Mapping[str, Any],
    spec: WorkloadSpec,
    *,
    profile: str | None = None,
    baseline_batch_size: int | None = None,
    progress: Progress | None = None,
    step_profile: bool = False,
    rounds: int = 1,
) -> dict[str, Any]:
    """Open an engine for ``model`` with ``flags``, run the workload, then (if
    ``baseline_batch_size`` is given) transformers on the same prompts; the JSON report.
    ``step_profile`` adds where the engine's steps spent their time.

    ``rounds`` > 1 repeats that pair, the engine afresh each time: the report keeps the
    median round of each side and the median of the rounds' ratios, since a ratio of
    two runs next to each other in time cancels a machine's drift from minute to minute.
    """
    from llmctl.options import options_for
    from llmctl.selection import select

    if rounds < 1:
        raise OptionError(f"--rounds must be at least 1, got {rounds}")
    choice = select(model, flags, profile=profile)
    info, backend, values = choice.model, choice.backend.name, choice.values
    import torch

    cuda = choice.hardware.device_for(values["device"]) == "cuda"
    model_config = ModelConfig.from_dict(info.config)
    dtype = engine_dtype(values["dtype"], model_config, torch.device("cuda" if cuda else "cpu"))
    workload = workload_for(info, spec)
    warmup = _warmup_request(info, spec.seed)
    load_at_start = load_average()
    engine_results, baselines = [], []
    for round_ in range(1, rounds + 1):
        label = "" if rounds == 1 else f" (round {round_} of {rounds})"
        engine = choice.create_engine()
        engine_results.append(
            asyncio.run(
                _run_then_shutdown(
                    engine, workload, MemoryPeak(cuda), warmup, progress, step_profile, label
                )
            )
        )
        engine = None  # free its memory before the baseline (or the next engine)
        gc.collect()
        if cuda:  # so the next engine's "fraction of free memory" sees it free
            torch.cuda.empty_cache()
        if baseline_batch_size is not None:
            baselines.append(
                _run_baseline(
                    info, workload, warmup, cuda, dtype, baseline_batch_size, progress, label
                )
            )
    engine_result = _median_run(engine_results)
    bytes_per_block = model_config.kv_bytes_per_block(
        engine_result["block_size"], dtype, values["kv_cache_dtype"]
    )
    engine_result["peak_kv_cache_bytes"] = engine_result["peak_kv_blocks_used"] * bytes_per_block
    ratios = [
        run["output_tokens_per_s"] / base["output_tokens_per_s"]
        for run, base in zip(engine_results, baselines)
    ]
    return {
        "kind": "throughput",
        "model": info.name,
        "backend": backend,
        "device": "cuda" if cuda else "cpu",
        "dtype": dtype,
        "machine": {**_machine(), "load_average": {"start": load_at_start, "end": load_average()}},
        "settings": {
            opt.name: _setting(opt.name, values[opt.name]) for opt in options_for("bench")
        },
        "workload": workload.describe(),
        "engine": engine_result,
        "baseline": _median_run(baselines) if baselines else None,
        "ratio": statistics.median(ratios) if ratios else None,
        "rounds": [
            {
                "engine_output_tokens_per_s": run["output_tokens_per_s"],
                "baseline_output_tokens_per_s": base["output_tokens_per_s"] if base else None,
                "ratio": ratio,
            }
            for run, base, ratio in itertools.zip_longest(engine_results, baselines, ratios)
        ],
    }


def _run_baseline(
    info: ModelInfo,
    workload: Workload,
    warmup: BenchRequest,
    cuda: bool,
    dtype: str,
    batch_size: int,
    progress: Progress | None,
    label: str,
) -> dict[str, Any]:
    from llmctl.bench.baseline_transformers import run_transformers_baseline

    task = _progress_task(progress, f"transformers{label}", workload.output_tokens)
    return run_transformers_baseline(
        info.path,
        workload,
        MemoryPeak(cuda),
        batch_size=batch_size,
        device="cuda" if cuda else "cpu",
        dtype=dtype,
        warmup=warmup,
        on_batch=lambda tokens: progress.advance(task, tokens) if progress else None,
    )


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output tokens/s (the lower middle one of an even count): a real
    run, so its figures agree with each other."""
    middle = statistics.median_low(run["output_tokens_per_s"] for run in runs)
    return next(run for run in runs if run["output_tokens_per_s"] == middle)


async def _run_then_shutdown(
    engine: Engine,
    workload: Workload,
    memory: MemoryPeak,
    warmup: BenchRequest,
    progress: Progress | None,
    step_profile: bool,
    label: str = "",
) -> dict[str, Any]:
    task = _progress_task(progress, f"engine{label}", workload.output_tokens)

    def advance(tokens: int) -> None:
        if progress is not None:
            progress.advance(task, tokens)

    try:
        return await run_engine_throughput(
            engine,
            workload,
            memory,
            warmup=warmup,
            on_progress=advance,
            step_profile=step_profile,
        )
    finally:
        await engine.shutdown()


def _progress_task(progress: Progress | None, label: str, total_tokens: int) -> Any:
    if progress is None:
        return None
    return progress.add_task(f"{label}: output tokens", total=total_tokens)


def _machine() -> dict[str, Any]:
    """Where the numbers come from: results on a shared or throttled machine differ."""
    import torch

    return {"description": Hardware.probe().describe(), "torch_threads": torch.get_num_threads()}


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS keeps none): a run beside
    other busy programs reads slower, and its ratios to a baseline swing."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # Windows has no getloadavg
        return None


def _setting(name: str, value: Any) -> Any:
    """An option value as the JSON report shows it; keys (a plugin's ``proxy_api_key``,
    say) are masked, since reports get shared."""
    if "key" in name and value:
        return "***"
    return _jsonable(value)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)
