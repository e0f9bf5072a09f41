"""``llmctl models``: the models llmctl can use here without downloading anything, and
``llmctl models MODEL``: what llmctl reads from one of them, and what is wrong with it."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import typer

from llmctl.cli.output import console, styled, wrapping_table

if TYPE_CHECKING:
    from llmctl.model.check import ModelReport
    from llmctl.model.info import ModelInfo


def register(app: typer.Typer) -> None:
    app.command("models")(models)


def models(
    model: str | None = typer.Argument(
        None,
        help="Show what llmctl reads from this model (`demo`, a local directory or a cached "
        "hub id) and any problem with it, instead of listing the models.",
        show_default=False,
    ),
) -> None:
    """List `demo` and the models in the local Hugging Face cache, with their architecture
    and the installed backends that support it; or, given MODEL, show what llmctl reads
    from it: architecture, sizes, dtype, weights, tokenizer, chat template.

    A model directory with a problem is an error (exit status 1) that says what is wrong.
    """
    if model is None:
        list_models()
    else:
        show_model(model)


def list_models() -> None:
    from llmctl.errors import ModelError
    from llmctl.model.info import hf_hub_cache, resolve_model

    names = ["demo"]
    cache = hf_hub_cache()
    if cache.is_dir():
        names += sorted(
            p.name.removeprefix("models--").replace("--", "/")
            for p in cache.iterdir()
            if p.name.startswith("models--")
        )
    table = wrapping_table(
        "model", "architecture", "backends that support it", "path", title="Models"
    )
    for name in names:
        try:
            info = resolve_model(name)
        except ModelError as exc:
            table.add_row(name, "-", styled(("unusable", "red"), f": {exc}"), "-")
            continue
        if info.problems:
            status = styled(("broken", "red"), f": see `llmctl models {name}`")
        else:
            status = ", ".join(_supporting_backends(info)) or "none"
        label = f"{name} (random weights)" if info.is_demo else name
        table.add_row(label, info.architecture, status, str(info.path))
    console.print(table)
    console.print(
        "Hugging Face cache: "
        f"{cache}. Local directories work too: llmctl serve PATH; details: llmctl models PATH"
    )


def show_model(name: str) -> None:
    from llmctl.errors import ModelError
    from llmctl.model.info import resolve_model

    info = resolve_model(name)
    with console.status("Reading the model's files…"):
        report = info.report
    table = wrapping_table(title=f"Model {info.name}", show_header=False)
    table.add_column(style="bold", overflow="fold")
    table.add_column(overflow="fold")
    for label, value in _facts(info, report):
        table.add_row(label, value)
    console.print(table)
    if info.is_demo:
        console.print("demo has random weights: its text is meaningless")
    if report.problems:
        raise ModelError(report.error_message())
    console.print(styled(("No problem found", "green"), f": llmctl serve {name}"))


def _facts(info: ModelInfo, report: ModelReport) -> list[tuple[str, str]]:
    from llmctl.kv_budget import format_bytes

    c = report.config
    facts = [("path", str(info.path)), ("architecture", f"{info.architecture} ({info.model_type})")]
    if c is not None:
        window = f", sliding window {c.sliding_window}" if c.sliding_window else ""
        rope = f"theta {c.rope_theta:g}" + (
            f", {c.rope_scaling.rope_type} scaling x{c.rope_scaling.factor:g}"
            if c.rope_scaling
            else ""
        )
        facts += [
            (
                "sizes",
                f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads "
                f"({c.num_kv_heads} KV heads) of {c.head_dim}, MLP {c.intermediate_size}, "
                f"vocab {c.vocab_size}" + (", tied embeddings" if c.tie_word_embeddings else ""),
            ),
            ("context", f"{c.max_position_embeddings} tokens{window}; RoPE {rope}"),
            ("dtype", f"{c.torch_dtype} (config.json)"),
        ]
    if report.weight_files:
        size = sum(f.stat().st_size for f in report.weight_files if f.is_file())
        weights = f"{len(report.weight_files)} file(s), {format_bytes(size)}"
        if report.tensors:
            params = sum(t.numel for t in report.tensors.values())
            dtypes = Counter(t.dtype for t in report.tensors.values()).most_common()
            weights += (
                f": {len(report.tensors)} tensors, {_count(params)} parameters "
                f"({', '.join(f'{n} {dtype}' for dtype, n in dtypes)})"
            )
        facts.append(("weights", weights))
    tokenizer = report.tokenizer
    if tokenizer is not None:
        bos = f"BOS {tokenizer.bos_token!r}" + (" added" if tokenizer.add_bos_token else "")
        facts.append(
            (
                "tokenizer",
                f"tokenizer.json, {tokenizer.vocab_size} tokens; {bos}; EOS ids "
                f"{list(tokenizer.eos_token_ids)}",
            )
        )
        template = tokenizer.chat_template_file
        facts.append(
            (
                "chat template",
                f"from {template.name}"
                if template
                else "none: chat requests are joined into a plain prompt",
            )
        )
    facts.append(("backends", ", ".join(_supporting_backends(info)) or "none installed"))
    return facts


def _supporting_backends(info: ModelInfo) -> list[str]:
    """Installed backends that load local models of this architecture (not checked
    against the hardware: `llmctl backends check MODEL` does that)."""
    from llmctl.selection import installed_backends

    return [
        b.name
        for b in installed_backends().values()
        if b.loads_local_model
        and (b.supported_architectures is None or info.architecture in b.supported_architectures)
    ]


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
