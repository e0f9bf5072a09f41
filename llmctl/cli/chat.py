"""``llmctl chat``: talk to a model in the terminal, in-process or through a server."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.text import Text

from llmctl.cli.output import console, err_console
from llmctl.cli.schema_flags import schema_options
from llmctl.errors import OptionError


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)


@schema_options("chat", skip=("model",))
def chat(
    flags: dict[str, Any],
    ctx: typer.Context,
    model: str | None = typer.Argument(
        None,
        help="Model: `smollm2-135m`, `demo`, a local directory, a GGUF file or a cached hub id "
        "\\[default: the profile's model, else smollm2-135m].",
        show_default=False,
    ),
    profile: str | None = typer.Option(None, "--profile", "-p", help="Profile to use."),
    url: str | None = typer.Option(
        None,
        "--url",
        help="Talk to a running OpenAI-compatible server (e.g. http://127.0.0.1:8000) "
        "instead of loading the model here.",
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="LLMCTL_API_KEY", help="With --url: the server's API key."
    ),
    ca_cert: str | None = typer.Option(
        None,
        "--ca-cert",
        help="With an https:// --url: the PEM file of the CA that signed the server's "
        "certificate (a private CA) \\[default: the system's CAs].",
        show_default=False,
    ),
    remote_model: str | None = typer.Option(
        None,
        "--model",
        help="With --url: the model to ask for \\[default: the server's only model].",
        show_default=False,
    ),
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    temperature: float | None = typer.Option(
        None,
        "--temperature",
        help="Sampling temperature \\[default: 0.7; 0 (greedy) when stdin is piped].",
        show_default=False,
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", help="Most tokens in one answer \\[default: 256].", show_default=False
    ),
) -> None:
    """Chat with a model in the terminal, here or through a server; /help lists commands.

    Piped (`echo "hi" | llmctl chat MODEL`): answers once on stdout, greedy by default.
    """
    from llmctl.chat.session import (
        DEFAULT_MAX_TOKENS,
        INTERACTIVE_TEMPERATURE,
        PIPED_TEMPERATURE,
        ChatSession,
        continuation_note,
    )
    from llmctl.chat.terminal import run_interactive, run_piped
    from llmctl.engine.sampling_params import SamplingParams
    from llmctl.paths import cache_dir

    interactive = sys.stdin.isatty()
    if temperature is None:
        temperature = INTERACTIVE_TEMPERATURE if interactive else PIPED_TEMPERATURE
    try:
        sampling = SamplingParams(
            temperature=temperature,
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        )
    except ValueError as exc:
        raise OptionError(f"{exc}: fix --temperature or --max-tokens") from None
    api_key_flag = ctx.get_parameter_source("api_key").name == "COMMANDLINE"  # not the env var
    _check_local_or_remote(url, model, remote_model, api_key_flag, flags, profile)
    if ca_cert is not None and not (url or "").startswith("https://"):
        raise OptionError("--ca-cert is for a server given with an https:// --url")

    piped_text = None if interactive else sys.stdin.read().rstrip("\r\n")
    if piped_text is not None and not piped_text.strip():  # say so before loading a model
        raise OptionError("nothing to answer: standard input was empty")

    connection, intro, warnings = _connect(
        url, api_key, model, remote_model, flags, profile, ca_cert
    )
    notes = console if interactive else err_console
    session = ChatSession(connection, sampling, system=system, notes=notes)
    if not session.chat_mode:
        warnings.append(continuation_note(connection.model_name))
    warnings = [Text(line, style="yellow") for line in warnings]
    if piped_text is not None:  # stdout is the answer alone; notes about it go to stderr
        for line in warnings:
            notes.print(line, soft_wrap=True)
        run_piped(session, piped_text)
        return
    run_interactive(session, banner=[intro, *warnings], history_file=cache_dir() / "chat_history")


def _check_local_or_remote(
    url: str | None,
    model: str | None,
    remote_model: str | None,
    api_key_flag: bool,
    flags: dict[str, Any],
    profile: str | None,
) -> None:
    """Refuse options that belong to the other way of chatting, rather than ignore them."""
    if url is None:
        if remote_model is not None or api_key_flag:
            raise OptionError(
                "--model and --api-key are for a server given with --url; to load a model "
                "here pass it as the argument: llmctl chat MODEL"
            )
        return
    from llmctl.chat.remote import check_url

    check_url(url)
    local_only = [f"--{name.replace('_', '-')}" for name in flags]
    if model is not None:
        local_only.insert(0, f"MODEL ({model})")
    if profile is not None:
        local_only.append("--profile")
    if local_only:
        raise OptionError(
            f"{', '.join(local_only)} configure a local engine, but --url talks to a server "
            "that has its own: drop them, or drop --url to load the model here (with --url, "
            "name the server's model with --model)"
        )


def _connect(
    url: str | None,
    api_key: str | None,
    model: str | None,
    remote_model: str | None,
    flags: dict[str, Any],
    profile: str | None,
    ca_cert: str | None = None,
) -> tuple[Any, Text, list[str]]:
    """The connection to chat through, a line introducing it and warnings about it."""
    from llmctl.chat.connection import LocalConnection
    from llmctl.chat.remote import RemoteConnection

    tail = "/help lists the commands; Ctrl-C stops an answer; Ctrl-D or /exit leaves."
    if url is not None:
        connection = RemoteConnection(url, api_key=api_key, model=remote_model, ca_cert=ca_cert)
        where = f"{connection.model_name} at {connection.base_url}"
        return connection, Text.assemble((f"Chatting with {where}.", "bold"), f" {tail}"), []
    from llmctl.model.demo import DEMO_LABEL
    from llmctl.selection import select

    choice = select(model, flags, profile=profile)
    engine = choice.create_engine()
    backend = choice.backend.name
    intro = Text.assemble((f"Chatting with {engine.model_name}", "bold"), f" ({backend}). {tail}")
    warnings = [f"Model {DEMO_LABEL}."] if choice.model.is_demo else []
    return LocalConnection(engine), intro, warnings
