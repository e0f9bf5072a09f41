"""``llmctl bench``: offline throughput, online serving load, the block-size sweep, and
what quantization costs in quality.

``throughput``, ``serve`` and ``sweep`` run a seeded workload of random prompt token ids
(special ids excluded), greedy with ``ignore_eos``; ``quality`` continues fixed prompts
greedily and scores a text (sampled from the unquantized model by default) on both
models. See docs/benchmarks.md for the JSON fields.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import typer

from llmctl.cli.output import console, err_console, styled
from llmctl.cli.schema_flags import schema_options

WORKLOAD_PANEL = "Workload"
OUTPUT_PANEL = "Output"

MODEL_ARG = typer.Argument(
    None,
    help="Model: `smollm2-135m`, `demo`, a local directory, a GGUF file or a cached hub id "
    "\\[default: the profile's model, else smollm2-135m].",
    show_default=False,
)
PROFILE_OPT = typer.Option(None, "--profile", "-p", help="Profile to use.")
NUM_PROMPTS_OPT = typer.Option(
    64, "--num-prompts", "-n", min=1, help="Requests to send.", rich_help_panel=WORKLOAD_PANEL
)
INPUT_LEN_OPT = typer.Option(
    "128",
    "--input-len",
    metavar="N|LOW:HIGH",
    help="Prompt tokens per request: fixed, or drawn uniformly from LOW..HIGH.",
    rich_help_panel=WORKLOAD_PANEL,
)
OUTPUT_LEN_OPT = typer.Option(
    "128",
    "--output-len",
    metavar="N|LOW:HIGH",
    help="Output tokens per request (ignore_eos: exactly this many): fixed or LOW:HIGH.",
    rich_help_panel=WORKLOAD_PANEL,
)
SEED_OPT = typer.Option(
    0,
    "--seed",
    help="Seed of the workload (prompts, lengths, arrivals).",
    rich_help_panel=WORKLOAD_PANEL,
)
OUTPUT_OPT = typer.Option(
    None,
    "--output",
    "-o",
    help="Write the full report as JSON to this file.",
    rich_help_panel=OUTPUT_PANEL,
)
MARKDOWN_OPT = typer.Option(
    False,
    "--markdown",
    help="Print the results as a markdown table.",
    rich_help_panel=OUTPUT_PANEL,
)


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Benchmark throughput and latency, each beside a baseline, and sweep block sizes.",
        no_args_is_help=True,
    )
    group.command("throughput")(throughput)
    group.command("serve")(serve)
    group.command("sweep")(sweep)
    group.command("quality")(quality)
    app.add_typer(group, name="bench")


@schema_options("bench", skip=("model",))
def throughput(
    flags: dict[str, Any],
    model: str | None = MODEL_ARG,
    profile: str | None = PROFILE_OPT,
    num_prompts: int = NUM_PROMPTS_OPT,
    input_len: str = INPUT_LEN_OPT,
    output_len: str = OUTPUT_LEN_OPT,
    seed: int = SEED_OPT,
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        metavar="transformers",
        help="Also run transformers' generate on the same prompts (batched, left-padded, "
        "greedy) and print the ratio of useful output tokens/s.",
    ),
    baseline_batch_size: int = typer.Option(
        64, "--baseline-batch-size", min=1, help="Requests per transformers generate call."
    ),
    rounds: int = typer.Option(
        1,
        "--rounds",
        min=1,
        help="Run the engine, then the baseline, this many times in turn, and report the "
        "median round of each and the median of the rounds' ratios (a machine whose speed "
        "drifts from minute to minute moves a single pair's ratio).",
    ),
    step_profile: bool = typer.Option(
        False,
        "--step-profile",
        help="Also show where the engine's steps spend their time: scheduling, building "
        "inputs, the model call, sampling, outputs and handing them over.",
        rich_help_panel=OUTPUT_PANEL,
    ),
    output: Path | None = OUTPUT_OPT,
    markdown: bool = MARKDOWN_OPT,
) -> None:
    """Offline throughput: all requests submitted at once to the engine.

    JSON fields (--output; details in docs/benchmarks.md):

    - model, backend, device, dtype, machine, settings (every engine option)
    - workload: num_prompts, input_len, output_len, seed, prompt_tokens, output_tokens
    - engine: duration_s, num_requests, prompt_tokens, output_tokens, requests_per_s,
      output_tokens_per_s, total_tokens_per_s, ttft_ms {mean, p50, p90, p99},
      peak_kv_blocks_used, kv_blocks_total, block_size, peak_kv_cache_bytes,
      peak_memory_bytes, memory_measure
    - engine.step_profile (with --step-profile): steps, scheduled_seqs, mean_batch_seqs,
      seconds per phase (schedule, inputs, model, sample, wait, outputs, deliver, idle),
      step_ms and share per phase, host_share, seq_us per phase and host_seq_us (µs per
      sequence per step); null for an engine that keeps none
    - baseline: the same figures for transformers plus batch_size and
      generated_tokens (padding included); null without --baseline
    - ratio: engine output_tokens_per_s / baseline output_tokens_per_s (with --rounds,
      the median of the rounds' ratios; engine and baseline are each the median round)
    - rounds: per round, engine_output_tokens_per_s, baseline_output_tokens_per_s and
      ratio (null without --baseline)
    """
    from llmctl.bench.report import load_average_text, step_profile_table, throughput_table
    from llmctl.bench.throughput import benchmark_throughput

    if baseline is not None and baseline != "transformers":
        from llmctl.errors import OptionError

        raise OptionError(f"--baseline {baseline!r}: the only baseline is `transformers`")
    spec = _workload_spec(num_prompts, input_len, output_len, seed)
    with _progress() as progress:
        report = benchmark_throughput(
            model,
            flags,
            spec,
            profile=profile,
            baseline_batch_size=baseline_batch_size if baseline else None,
            progress=progress,
            step_profile=step_profile,
            rounds=rounds,
        )
    title = f"Throughput: {report['model']} on {report['backend']} ({report['device']})"
    _show(throughput_table(report), title, markdown, output, report)
    if step_profile:
        profile = report["engine"]["step_profile"]
        if profile is None:
            console.print(f"The {report['backend']} engine keeps no step profile.")
        else:
            _show(step_profile_table(profile), "Where a step's time goes", markdown, None, report)
    rounds = report["rounds"]
    if len(rounds) > 1:
        console.print("Rounds, output tokens/s: " + "; ".join(map(_round_text, rounds)))
    load = report["machine"]["load_average"]
    if load["start"] is not None:
        console.print(load_average_text(load["start"], load["end"]))
    if report["ratio"] is None:
        return
    if len(rounds) > 1:  # a ratio of each round's own pair, not of the two medians
        text = f"llmctl ({report['backend']}) vs transformers, the median of the rounds' ratios: "
    else:
        text = (
            f"llmctl ({report['backend']}) {report['engine']['output_tokens_per_s']:,.1f} vs "
            f"transformers {report['baseline']['output_tokens_per_s']:,.1f} useful output "
            "tokens/s: "
        )
    console.print(styled(text, (f"{report['ratio']:.2f}x", "bold")))


def _round_text(round_: dict[str, Any]) -> str:
    text = f"{round_['engine_output_tokens_per_s']:,.1f}"
    if round_["ratio"] is not None:
        text += f" vs {round_['baseline_output_tokens_per_s']:,.1f} ({round_['ratio']:.2f}x)"
    return text


def serve(
    url: str = typer.Option(..., "--url", help="Server base URL, e.g. http://127.0.0.1:8000."),
    model: str | None = typer.Option(
        None, "--model", help="Model name to ask for. Default: the first one /v1/models lists."
    ),
    tokenizer: str | None = typer.Option(
        None,
        "--tokenizer",
        help="Model (`demo`, directory, GGUF file or cached hub id) whose vocabulary the prompt token "
        "ids come from. Default: the served model name, if it is a model found here.",
    ),
    num_prompts: int = NUM_PROMPTS_OPT,
    concurrency: int | None = typer.Option(
        None, "--concurrency", "-c", min=1, help="Requests in flight at most."
    ),
    request_rate: float | None = typer.Option(
        None, "--request-rate", "-r", help="Requests started per second (Poisson arrivals)."
    ),
    input_len: str = INPUT_LEN_OPT,
    output_len: str = OUTPUT_LEN_OPT,
    seed: int = SEED_OPT,
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="LLMCTL_API_KEY", help="Sent as `Authorization: Bearer KEY`."
    ),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request may take."),
    output: Path | None = OUTPUT_OPT,
    markdown: bool = MARKDOWN_OPT,
) -> None:
    """Online load on a running server through streaming /v1/completions.

    Give --concurrency, --request-rate, or both.

    JSON fields (--output; details in docs/benchmarks.md):

    - url, model, load {concurrency, request_rate}, workload
    - result: duration_s, num_requests, completed, errors, error_examples,
      prompt_tokens, output_tokens, requested_output_tokens, requests_per_s,
      output_tokens_per_s, total_tokens_per_s, and ttft_ms, tpot_ms, itl_ms,
      latency_ms, each {mean, p50, p90, p99}
    """
    from llmctl.bench.report import serve_table
    from llmctl.bench.serve_load import run_serve_load, served_model_name
    from llmctl.bench.throughput import workload_for

    url = url.rstrip("/")
    spec = _workload_spec(num_prompts, input_len, output_len, seed)
    if concurrency is None and request_rate is None:
        from llmctl.errors import OptionError

        raise OptionError("give --concurrency N, --request-rate R, or both")
    model = model or asyncio.run(served_model_name(url, api_key))
    workload = workload_for(
        _vocabulary_model(tokenizer or model, given=tokenizer is not None), spec
    )
    with _progress() as progress:
        task = progress.add_task("serve: requests", total=num_prompts)
        result = asyncio.run(
            run_serve_load(
                url,
                model,
                workload,
                concurrency=concurrency,
                request_rate=request_rate,
                api_key=api_key,
                timeout_s=timeout,
                on_done=lambda: progress.advance(task),
            )
        )
    report = {
        "kind": "serve",
        "url": url,
        "model": model,
        "load": {"concurrency": concurrency, "request_rate": request_rate},
        "workload": workload.describe(),
        "result": result,
    }
    _show(serve_table(report), f"Serve load: {model} at {url}", markdown, output, report)
    for example in result["error_examples"]:
        err_console.print(styled(("error:", "red"), f" {example}"))


@schema_options("bench", skip=("model",))
def sweep(
    flags: dict[str, Any],
    model: str | None = MODEL_ARG,
    cache_block_seq_len: str = typer.Option(
        "16,32,64,128",
        "--cache-block-seq-len",
        metavar="N,N,...",
        help="Block sizes to compare (tokens per KV-cache block), comma-separated.",
    ),
    profile: str | None = PROFILE_OPT,
    num_prompts: int = NUM_PROMPTS_OPT,
    input_len: str = INPUT_LEN_OPT,
    output_len: str = OUTPUT_LEN_OPT,
    seed: int = SEED_OPT,
    serve: bool = typer.Option(
        False, "--serve", help="Also start `llmctl serve` per block size and load it."
    ),
    concurrency: int | None = typer.Option(
        None, "--concurrency", "-c", min=1, help="Serve runs: requests in flight (default 8)."
    ),
    request_rate: float | None = typer.Option(
        None, "--request-rate", "-r", help="Serve runs: requests started per second."
    ),
    chart: Path = typer.Option(
        Path("llmctl-sweep.png"),
        "--chart",
        help="Where to write the PNG chart.",
        rich_help_panel=OUTPUT_PANEL,
    ),
    output: Path | None = OUTPUT_OPT,
    markdown: bool = MARKDOWN_OPT,
) -> None:
    """Throughput (and with --serve, serving latency) per block size, with a chart.

    JSON fields (--output; details in docs/benchmarks.md):

    - model, backend, device, workload
    - serve_load: {concurrency, request_rate}, null without --serve
    - runs: one per block size: block_size, throughput (a `bench throughput`
      report) and serve (a `bench serve` result, or null)
    """
    from llmctl.bench.report import sweep_table
    from llmctl.bench.sweep import parse_block_sizes, run_sweep, write_chart

    block_sizes = parse_block_sizes(cache_block_seq_len)
    spec = _workload_spec(num_prompts, input_len, output_len, seed)
    if serve and concurrency is None and request_rate is None:
        concurrency = 8
    with _progress() as progress:
        report = run_sweep(
            model,
            flags,
            block_sizes,
            spec,
            profile=profile,
            serve_concurrency=concurrency if serve else None,
            serve_request_rate=request_rate if serve else None,
            progress=progress,
        )
    write_chart(report, chart)
    title = f"Block-size sweep: {report['model']} on {report['backend']} ({report['device']})"
    _show(sweep_table(report), title, markdown, output, report)
    console.print(f"Chart written to {chart}")


@schema_options("bench", skip=("model",))
def quality(
    flags: dict[str, Any],
    model: str | None = MODEL_ARG,
    profile: str | None = PROFILE_OPT,
    num_prompts: int = typer.Option(
        16,
        "--num-prompts",
        "-n",
        min=1,
        max=16,
        help="Fixed prompts to continue greedily (the first N of 16).",
        rich_help_panel=WORKLOAD_PANEL,
    ),
    max_tokens: int = typer.Option(
        64,
        "--max-tokens",
        min=1,
        help="Tokens per greedy continuation.",
        rich_help_panel=WORKLOAD_PANEL,
    ),
    text: Path | None = typer.Option(
        None,
        "--text",
        help="A text file whose perplexity both models score. Default: text sampled from "
        "the unquantized model (temperature 1, --seed).",
        rich_help_panel=WORKLOAD_PANEL,
    ),
    text_tokens: int = typer.Option(
        256,
        "--text-tokens",
        min=2,
        help="Tokens of the sampled text.",
        rich_help_panel=WORKLOAD_PANEL,
    ),
    seed: int = SEED_OPT,
    output: Path | None = OUTPUT_OPT,
    markdown: bool = MARKDOWN_OPT,
) -> None:
    """Quality beside speed: the model with --quantization / --kv-cache-dtype against the
    same model unquantized, on the same backend (both loaded, timed turn by turn).

    Greedy agreement (steps up to each prompt's first difference), teacher-forced
    top-1 agreement, perplexity of a fixed text, batch-1 tokens/s, weight and KV bytes.

    JSON fields (--output; details in docs/quantization.md):

    - model, backend, device, dtype, workload
    - baseline: options, tokens_per_s, weight_bytes, kv_bytes_per_token, perplexity,
      greedy_token_ids
    - runs: per variant options, the same figures, baseline_tokens_per_s (timed beside
      it), greedy_agreement, first_differences, teacher_forced_agreement and ratios
      (to the baseline)
    """
    from llmctl.bench.quality import QualitySpec, benchmark_quality
    from llmctl.bench.report import quality_table

    text_ids = None
    if text is not None:
        text_ids = _text_token_ids(model, text)
    spec = QualitySpec(num_prompts, max_tokens, text_tokens, seed, text_ids)
    with _progress() as progress:
        report = benchmark_quality(model, flags, spec, profile=profile, progress=progress)
    title = f"Quality: {report['model']} on {report['backend']} ({report['device']})"
    _show(quality_table(report), title, markdown, output, report)


def _text_token_ids(model: str, path: Path) -> tuple[int, ...]:
    from llmctl.errors import OptionError
    from llmctl.model.info import resolve_model
    from llmctl.model.tokenizer import Tokenizer

    try:
        content = path.read_text()
    except OSError as exc:
        raise OptionError(f"--text {path}: {exc.strerror}") from None
    ids = Tokenizer.from_dir(resolve_model(model).path).encode(content, add_special_tokens=False)
    if len(ids) < 2:
        raise OptionError(f"--text {path}: the text must hold at least 2 tokens")
    return tuple(ids)


def _workload_spec(num_prompts: int, input_len: str, output_len: str, seed: int) -> Any:
    from llmctl.bench.throughput import WorkloadSpec
    from llmctl.bench.workload import parse_length_range

    return WorkloadSpec(
        num_prompts,
        parse_length_range(input_len, "--input-len"),
        parse_length_range(output_len, "--output-len"),
        seed,
    )


def _vocabulary_model(name: str, *, given: bool) -> Any:
    from llmctl.errors import LlmctlError
    from llmctl.model.info import resolve_model

    try:
        return resolve_model(name)
    except LlmctlError as exc:
        if given:
            raise
        raise LlmctlError(
            f"the prompts are token ids from the served model's vocabulary, but the model "
            f"{name!r} is not found here ({exc}). Pass --tokenizer with its directory (or "
            "`demo`)"
        ) from None


def _progress() -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def _show(
    table: Any, title: str, markdown: bool, output: Path | None, report: dict[str, Any]
) -> None:
    from llmctl.bench.report import markdown as to_markdown
    from llmctl.bench.report import rich_table, write_json

    if markdown:
        typer.echo(f"**{title}**\n\n{to_markdown(table)}")
    else:
        console.print(rich_table(table, title))
    if output is not None:
        write_json(report, output)
        console.print(f"Report written to {output}")
