"""``llmctl bench quality``: what quantization costs in quality, beside what it saves.

The same model runs twice on the same backend: unquantized (``quantization=none``,
``kv_cache_dtype=auto``), then with the quantization options given. For each run:

- greedy generation of ``max_tokens`` tokens for each of the fixed ``PROMPTS``, one
  prompt at a time (batch 1; the tokens per second are the decode speed reported), and
  each quantized continuation is compared with the unquantized one: **greedy
  agreement** counts the steps up to each prompt's first difference;
- **teacher-forced agreement**: the quantized model is fed the unquantized greedy
  tokens and its top token is compared at every step (a near-tie that flips early no
  longer hides every later step, so this measures the per-step error);
- **perplexity** of a fixed text: by default text sampled once from the unquantized
  model with ``seed`` (temperature 1, from the BOS token), scored by both models;
- the bytes of the weights and of one token's KV cache.

Teacher forcing drives the engine's runner directly (a paged decode step per token),
so it needs a local backend; both engines run with prefix caching off, so what the
runner writes into cache blocks can never be served to a later request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmctl.api import LLM
from llmctl.bench.report import variant_label
from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.runner import PagedRunner, StepBatch
from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import LlmctlError, OptionError

if TYPE_CHECKING:
    from rich.progress import Progress

# Sixteen short story openings, written by hand (not chosen by any result): the fixed
# prompts of the greedy comparison. Plain English, so they suit any English model.
PROMPTS = (
    "Once upon a time, there was a little girl named Lily.",
    "One day, a big dog found a red ball in the park.",
    "Tom and his mom went to the store to buy",
    "There was a small bird who lived in a tall tree.",
    "Sara liked to paint pictures of the sun and the sky.",
    "The cat was very hungry, so it looked for",
    "Ben had a shiny new toy car. He wanted to",
    "It was a rainy day and Mia could not go outside.",
    "A little boy named Max loved to play with his blocks.",
    "The old man had a garden full of flowers.",
    "Lucy and her friend Sam found a box under the bed.",
    "Once there was a happy frog who liked to jump.",
    "Anna wanted to bake a cake for her dad.",
    "The sun was hot, so the children went to the lake.",
    "Tim saw a big truck on the road. It was",
    "In a small house lived a kind girl and her fluffy bunny.",
)
UNQUANTIZED = {"quantization": "none", "kv_cache_dtype": "auto"}


@dataclass(frozen=True)
class QualitySpec:
    num_prompts: int = len(PROMPTS)
    max_tokens: int = 64
    text_tokens: int = 256  # length of the sampled text (when no text is given)
    seed: int = 0
    text_token_ids: tuple[int, ...] | None = None  # a fixed text instead of a sampled one


@dataclass
class Scored:
    """One teacher-forced sequence: at each position after its prompt, the model's top
    token and the log-probability of the token that actually follows."""

    top_tokens: list[int]
    logprobs: list[float]


def benchmark_quality(
    model: str,
    flags: Mapping[str, Any],
    spec: QualitySpec,
    *,
    variants: Sequence[Mapping[str, str]] | None = None,
    profile: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the unquantized model, then each variant (``quantization`` /
    ``kv_cache_dtype`` values, the unquantized ones where a variant leaves one out;
    default: the one ``flags`` and the profile set); the report.

    Every run uses the backend the first variant resolves to, so speeds compare."""
    from llmctl.selection import select

    if not 1 <= spec.num_prompts <= len(PROMPTS):
        raise OptionError(f"--num-prompts must be 1..{len(PROMPTS)}, got {spec.num_prompts}")
    flags = {**flags, "enable_prefix_caching": False}
    if variants is not None:
        variants = [{**UNQUANTIZED, **variant} for variant in variants]
    first = select(model, {**flags, **(variants[0] if variants else {})}, profile=profile)
    if variants is None:
        variants = [{name: first.values[name] for name in UNQUANTIZED}]
    if UNQUANTIZED in variants:
        raise OptionError(
            "nothing to compare: give --quantization int8 and/or --kv-cache-dtype int8|fp8 "
            "(the benchmark runs the unquantized model itself)"
        )
    flags["backend"] = first.backend.name
    task = _task(progress, "unquantized", spec)
    with _open(model, {**flags, **UNQUANTIZED}, profile) as llm:
        baseline, text, prompts = _run_baseline(llm, spec, progress, task)
    runs = []
    for variant in variants:
        task = _task(progress, variant_label(variant, UNQUANTIZED), spec)
        with _open(model, {**flags, **variant}, profile) as llm:
            runs.append(_run_variant(llm, variant, baseline, prompts, text, progress, task))
    return {
        "kind": "quality",
        "model": first.model.name,
        "backend": first.backend.name,
        "device": first.hardware.device_for(first.values["device"]),
        "dtype": first.values["dtype"],
        "workload": {
            "num_prompts": spec.num_prompts,
            "max_tokens": spec.max_tokens,
            "text_tokens": len(text) - 1,
            "text": "given" if spec.text_token_ids is not None else f"sampled, seed {spec.seed}",
        },
        "baseline": baseline,
        "runs": runs,
    }


def _open(model: str, flags: Mapping[str, Any], profile: str | None) -> LLM:
    options = dict(flags)
    return LLM(model, backend=options.pop("backend"), profile=profile, **options)


def _run_baseline(
    llm: LLM, spec: QualitySpec, progress: Progress | None, task: Any
) -> tuple[dict[str, Any], list[int], list[list[int]]]:
    engine, runner = _local(llm)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[: spec.num_prompts]]
    if spec.text_token_ids is not None:
        text = [_start_token(runner, prompts), *spec.text_token_ids]
    else:
        text = _sample_text(llm, _start_token(runner, prompts), spec)
    outputs, seconds = _greedy_one_by_one(llm, prompts, spec.max_tokens, progress, task)
    scored = score(runner, [text], [1])[0]
    _advance(progress, task, len(text) - 1)
    return (
        {
            "options": UNQUANTIZED,
            **_figures(runner, outputs, seconds, scored),
            "greedy_token_ids": outputs,
        },
        text,
        prompts,
    )


def _run_variant(
    llm: LLM,
    variant: Mapping[str, str],
    baseline: dict[str, Any],
    prompts: list[list[int]],
    text: list[int],
    progress: Progress | None,
    task: Any,
) -> dict[str, Any]:
    _, runner = _local(llm)
    reference = baseline["greedy_token_ids"]
    forced = score(runner, [p + r for p, r in zip(prompts, reference)], [len(p) for p in prompts])
    scored = score(runner, [text], [1])[0]
    _advance(progress, task, len(text) - 1)
    outputs, seconds = _greedy_one_by_one(llm, prompts, len(reference[0]), progress, task)
    figures = _figures(runner, outputs, seconds, scored)
    first_differences = [_first_difference(a, b) for a, b in zip(reference, outputs)]
    total = sum(len(r) for r in reference)
    # The prediction at step i follows the reference's tokens up to i - 1.
    forced_agree = sum(
        top == want for seq, ref in zip(forced, reference) for top, want in zip(seq.top_tokens, ref)
    )
    return {
        "options": dict(variant),
        **figures,
        "greedy_agreement": sum(first_differences) / total,
        "first_differences": first_differences,
        "teacher_forced_agreement": forced_agree / total,
        "ratios": {
            "tokens_per_s": figures["tokens_per_s"] / baseline["tokens_per_s"],
            "weight_bytes": _ratio(figures["weight_bytes"], baseline["weight_bytes"]),
            "kv_bytes_per_token": figures["kv_bytes_per_token"] / baseline["kv_bytes_per_token"],
            "perplexity": figures["perplexity"] / baseline["perplexity"],
        },
    }


def _figures(
    runner: PagedRunner, outputs: list[list[int]], seconds: float, scored: Scored
) -> dict[str, Any]:
    tokens = sum(len(o) for o in outputs)
    return {
        "tokens_per_s": tokens / seconds,
        "weight_bytes": runner.weight_bytes(),
        "kv_bytes_per_token": runner.kv_bytes_per_block() / runner.block_size,
        "perplexity": math.exp(-sum(scored.logprobs) / len(scored.logprobs)),
    }


def _greedy_one_by_one(
    llm: LLM, prompts: list[list[int]], max_tokens: int, progress: Progress | None, task: Any
) -> tuple[list[list[int]], float]:
    """Each prompt's greedy continuation, one request at a time (batch-1 decode)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:1]], SamplingParams(max_tokens=2))  # warm up
    outputs, seconds = [], 0.0
    for prompt in prompts:
        started = time.perf_counter()
        outputs.append(llm.generate([prompt], sampling)[0].token_ids)
        seconds += time.perf_counter() - started
        _advance(progress, task, max_tokens)
    return outputs, seconds


def _sample_text(llm: LLM, start: int, spec: QualitySpec) -> list[int]:
    sampling = SamplingParams(
        max_tokens=spec.text_tokens, temperature=1.0, seed=spec.seed, ignore_eos=True
    )
    return [start, *llm.generate([[start]], sampling)[0].token_ids]


def _start_token(runner: PagedRunner, prompts: list[list[int]]) -> int:
    """The token the text follows: BOS, or (a model without one) the first prompt's first."""
    bos = runner.config.bos_token_id
    return bos if bos is not None else prompts[0][0]


def score(runner: PagedRunner, sequences: list[list[int]], prompt_lens: list[int]) -> list[Scored]:
    """Teacher forcing through ``runner``: each sequence's prompt is prefilled in one step,
    then its following tokens are fed one per step (a decode step over the paged cache,
    every sequence in the same batch); at each position the model's top token and the
    log-probability of the sequence's next token are kept.

    Writes the runner's cache blocks from 0 on: only for an idle engine whose blocks
    hold nothing a request could reuse (prefix caching off)."""
    import torch

    bs = runner.block_size
    tables, next_block = [], 0
    for tokens in sequences:
        count = -(-len(tokens) // bs)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    if next_block > runner.num_blocks:
        raise LlmctlError(
            f"teacher forcing needs {next_block} KV blocks but the cache has "
            f"{runner.num_blocks}: raise --cache-max-entry-count"
        )
    scored = [Scored([], []) for _ in sequences]
    done = [0] * len(sequences)  # tokens already in each sequence's cache
    new = list(prompt_lens)
    while True:
        active = [i for i, tokens in enumerate(sequences) if done[i] + new[i] <= len(tokens) - 1]
        if not active:
            return scored
        batch = StepBatch([], [], [], [], [], [])
        for i in active:
            start, end = done[i], done[i] + new[i]
            batch.input_ids += sequences[i][start:end]
            batch.positions += range(start, end)
            batch.query_lens.append(end - start)
            batch.context_lens.append(end)
            batch.block_tables.append(tables[i])
            batch.slot_mapping += [tables[i][p // bs] * bs + p % bs for p in range(start, end)]
        logprobs = torch.log_softmax(runner.execute(batch).double(), dim=-1)
        for row, i in enumerate(active):
            done[i] += new[i]
            new[i] = 1
            scored[i].top_tokens.append(int(logprobs[row].argmax()))
            scored[i].logprobs.append(float(logprobs[row, sequences[i][done[i]]]))


def _local(llm: LLM) -> tuple[AsyncEngine, PagedRunner]:
    engine = llm.engine
    if not isinstance(engine, AsyncEngine):
        raise LlmctlError(
            f"bench quality scores tokens through the engine's model runner, which backend "
            f"{llm.backend} does not expose: use a local backend (torch or turbo)"
        )
    return engine, engine.engine.runner


def _first_difference(reference: list[int], candidate: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b), len(reference))


def _ratio(value: int | None, base: int | None) -> float | None:
    return None if value is None or not base else value / base


def _task(progress: Progress | None, label: str, spec: QualitySpec) -> Any:
    if progress is None:
        return None
    total = spec.num_prompts * spec.max_tokens + spec.text_tokens
    return progress.add_task(f"{label}: tokens", total=total)


def _advance(progress: Progress | None, task: Any, tokens: int) -> None:
    if progress is not None:
        progress.advance(task, tokens)
