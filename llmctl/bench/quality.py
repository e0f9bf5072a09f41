"""``llmctl bench quality``: what quantization costs in quality, beside what it saves.

The same model is loaded unquantized (``quantization=none``, ``kv_cache_dtype=auto``)
and with each set of quantization options asked for, on the same backend. For each:

- greedy generation of ``max_tokens`` tokens for each of the fixed ``PROMPTS``, one
  request at a time (batch 1), alternating between the two models prompt by prompt, so
  a machine that slows down (shared with other work) slows both and their speed ratio
  holds; **greedy agreement** counts the steps up to each prompt's first difference;
- **teacher-forced agreement**: the quantized model is fed the unquantized greedy
  tokens and its top token is compared at every step (a near-tie that flips early no
  longer hides every later step, so this measures the per-step error);
- **perplexity** of a fixed text: by default text sampled once from the unquantized
  model with ``seed`` (temperature 1, from the BOS token), scored by both models;
- the bytes of the weights and of one token's KV cache.

Teacher forcing drives the engine's runner directly (a paged decode step per token),
so it needs a local backend; the engines run with prefix caching off, so what the
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
# The baseline's options: the group options too, which mean nothing without quantization.
UNQUANTIZED = {
    "quantization": "none",
    "quantization_group_size": None,
    "quantization_zero_point": None,
    "kv_cache_dtype": "auto",
}


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
    model: str | None,
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
    # At most 16 sequences run at once, so the KV cache need not be sized for more
    # (an explicit --max-batch-size still wins).
    flags = {"max_batch_size": len(PROMPTS), **flags, "enable_prefix_caching": False}
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
    with _open(model, {**flags, **UNQUANTIZED}, profile) as unquantized:
        engine, runner = _local(unquantized)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS[: spec.num_prompts]]
        start = _start_token(runner, prompts)
        if spec.text_token_ids is not None:
            text = [start, *spec.text_token_ids]
        else:
            text = _sample_text(unquantized, start, spec)
        baseline = {"options": UNQUANTIZED, **_static_figures(runner, text)}
        runs = []
        for variant in variants:
            task = _task(progress, variant_label(variant, UNQUANTIZED), spec)
            with _open(model, {**flags, **variant}, profile) as quantized:
                runs.append(
                    _compare(
                        unquantized,
                        quantized,
                        variant,
                        baseline,
                        prompts,
                        text,
                        spec.max_tokens,
                        progress,
                        task,
                    )
                )
    # Every round's unquantized tokens are the same (greedy, batch 1): keep one copy.
    baseline["greedy_token_ids"] = [run.pop("baseline_token_ids") for run in runs][0]
    baseline["tokens_per_s"] = runs[0]["baseline_tokens_per_s"]
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


def _open(model: str | None, flags: Mapping[str, Any], profile: str | None) -> LLM:
    options = dict(flags)
    return LLM(model, backend=options.pop("backend"), profile=profile, **options)


def _compare(
    unquantized: LLM,
    quantized: LLM,
    variant: Mapping[str, str],
    baseline: dict[str, Any],
    prompts: list[list[int]],
    text: list[int],
    max_tokens: int,
    progress: Progress | None,
    task: Any,
) -> dict[str, Any]:
    """One variant against the unquantized model, both loaded: each prompt's greedy run
    on one then the other, so a machine that slows down slows both (their speed ratio
    holds even where others share the machine); then teacher forcing and perplexity."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for llm in (unquantized, quantized):  # warm up: first steps pay one-off costs
        llm.generate([prompts[0][:1]], SamplingParams(max_tokens=2))
    reference, outputs, seconds = [], [], {id(unquantized): 0.0, id(quantized): 0.0}
    for prompt in prompts:
        for llm, tokens in ((unquantized, reference), (quantized, outputs)):
            started = time.perf_counter()
            tokens.append(llm.generate([prompt], sampling)[0].token_ids)
            seconds[id(llm)] += time.perf_counter() - started
        _advance(progress, task, max_tokens)
    _, runner = _local(quantized)
    # The prediction at step i follows the reference's tokens up to i - 1.
    forced = score(runner, [p + r for p, r in zip(prompts, reference)], [len(p) for p in prompts])
    forced_agree = sum(
        top == want for seq, ref in zip(forced, reference) for top, want in zip(seq.top_tokens, ref)
    )
    figures = _static_figures(runner, text)
    _advance(progress, task, len(text) - 1)
    total = sum(len(r) for r in reference)
    first_differences = [first_difference(a, b) for a, b in zip(reference, outputs)]
    speed = total / seconds[id(quantized)]
    baseline_speed = total / seconds[id(unquantized)]
    return {
        "options": dict(variant),
        "tokens_per_s": speed,
        "baseline_tokens_per_s": baseline_speed,
        **figures,
        "greedy_agreement": sum(first_differences) / total,
        "first_differences": first_differences,
        "teacher_forced_agreement": forced_agree / total,
        "ratios": {
            "tokens_per_s": speed / baseline_speed,
            "weight_bytes": _ratio(figures["weight_bytes"], baseline["weight_bytes"]),
            "kv_bytes_per_token": figures["kv_bytes_per_token"] / baseline["kv_bytes_per_token"],
            "perplexity": figures["perplexity"] / baseline["perplexity"],
        },
        "baseline_token_ids": reference,
    }


def _static_figures(runner: PagedRunner, text: list[int]) -> dict[str, Any]:
    """Weight and KV bytes, and the perplexity of ``text`` (teacher forcing from its first
    token)."""
    scored = score(runner, [text], [1])[0]
    return {
        "weight_bytes": runner.weight_bytes(),
        "kv_bytes_per_token": runner.kv_bytes_per_block() / runner.block_size,
        "perplexity": math.exp(-sum(scored.logprobs) / len(scored.logprobs)),
    }


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


def first_difference(reference: list[int], candidate: list[int]) -> int:
    """How many leading tokens of ``candidate`` equal those of ``reference``."""
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
