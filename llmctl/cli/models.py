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
        help="Show what llmctl reads from this model (`smollm2-135m`, `demo`, a local "
        "directory, a GGUF file or a cached hub id) and any problem with it, instead of "
        "listing the models.",
        show_default=False,
    ),
) -> None:
    """List the default model `smollm2-135m`, `demo` and the models in the local Hugging
    Face cache, with their architecture and the installed backends that support it; or,
    given MODEL, show what llmctl reads from it: architecture, sizes, dtype, weights (with
    a GGUF file's tensor types and their counts), tokenizer, chat template.

    A model directory with a problem is an error (exit status 1) that says what is wrong.
    """
    if model is None:
        list_models()
    else:
        show_model(model)


def list_models() -> None:
    from llmctl.errors import ModelError
    from llmctl.model.info import DEFAULT_MODEL, DEMO_NAME, hf_hub_cache, resolve_model

    names = [DEFAULT_MODEL, DEMO_NAME]
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
        f"{cache}. Local directories and GGUF files work too: llmctl serve PATH; details: "
        "llmctl models PATH"
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
    from llmctl.model.gguf import gguf_file

    gguf = gguf_file(info.path) is not None
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
            (
                "dtype",
                f"{c.torch_dtype} ("
                + (
                    "GGUF general.file_type; quantized blocks are dequantized to it)"
                    if gguf
                    else "config.json)"
                ),
            ),
        ]
    if report.weight_files:
        size = sum(f.stat().st_size for f in report.weight_files if f.is_file())
        files = "GGUF file" if gguf else f"{len(report.weight_files)} file(s)"
        weights = f"{files}, {format_bytes(size)}"
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
        source = _gguf_tokenizer_kind(info) if gguf else "tokenizer.json"
        facts.append(
            (
                "tokenizer",
                f"{source}, {tokenizer.vocab_size} tokens; {bos}; EOS ids "
                f"{list(tokenizer.eos_token_ids)}",
            )
        )
        template = tokenizer.chat_template_file
        if template is None:
            shown = "none: chat requests are joined into a plain prompt"
        elif gguf:
            shown = "from the GGUF metadata (tokenizer.chat_template)"
        else:
            shown = f"from {template.name}"
        if tokenizer.chat_template and template is None:
            shown = "from the chat_template option"
        facts.append(("chat template", shown))
    facts.append(("backends", ", ".join(_supporting_backends(info)) or "none installed"))
    return facts


def _gguf_tokenizer_kind(info: ModelInfo) -> str:
    """``GGUF metadata (gpt2 byte-level BPE, pre-tokenizer smollm)``."""
    from llmctl.model.gguf import open_gguf

    model = open_gguf(info.path)
    kind = model.value("tokenizer.ggml.model")
    described = {"gpt2": "gpt2 byte-level BPE", "llama": "llama SentencePiece BPE"}.get(kind, kind)
    pre = model.value("tokenizer.ggml.pre")
    return f"GGUF metadata ({described}" + (f", pre-tokenizer {pre})" if pre else ")")


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
