"""``llmctl serve``: an OpenAI-compatible HTTP server in front of one engine."""

from __future__ import annotations

from typing import Any

import typer

from llmctl.cli.output import console, err_console
from llmctl.cli.schema_flags import schema_options


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@schema_options("serve", skip=("model",))
def serve(
    flags: dict[str, Any],
    model: str | None = typer.Argument(
        None,
        help="Model: `demo` (built-in, random weights), a local Hugging Face directory or a "
        "hub id already in the local cache. Default: the profile's model, else `demo`.",
        show_default=False,
    ),
    profile: str | None = typer.Option(
        None, "--profile", "-p", help="Profile to use (else LLMCTL_PROFILE)."
    ),
    api_key: list[str] | None = typer.Option(
        None,
        "--api-key",
        help="An API key clients must send (repeat for several); same as --api-keys.",
        metavar="KEY",
        rich_help_panel="Server options",
        show_default=False,
    ),
) -> None:
    """Serve MODEL over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models).

    Also /health, /metrics (Prometheus) and /version, which need no API key.

    SIGINT/SIGTERM: new requests get 503, running ones finish (up to --shutdown-timeout).
    """
    from llmctl.selection import open_engine, resolve_common
    from llmctl.server.app import create_app
    from llmctl.server.run import bind_socket, run_server, url_of

    if api_key:
        flags = {**flags, "api_keys": [*flags.get("api_keys", []), *api_key]}
    # Take the port before loading the model, so a port in use fails in a second.
    _, common = resolve_common(flags, profile)
    address = (common["host"].value, common["port"].value)
    sock = bind_socket(*address)
    with err_console.status("Loading the model…"):
        opened = open_engine(model, flags, profile=profile)
    options = opened.choice.values
    if (options["host"], options["port"]) != address:  # the backend's profile section
        sock.close()
        sock = bind_socket(options["host"], options["port"])
    app = create_app(
        opened.engine,
        backend_name=opened.choice.backend.name,
        api_keys=options["api_keys"],
        max_concurrent_requests=options["max_concurrent_requests"],
        max_queued_requests=options["max_queued_requests"],
        log_prompts=options["log_prompts"],
        client_timeout=options["client_timeout"],
    )
    _print_banner(opened, options, url_of(sock))
    run_server(app, sock, shutdown_timeout=options["shutdown_timeout"])


def _print_banner(opened: Any, options: dict[str, Any], url: str) -> None:
    """What a user needs to know before the first request: what serves, how big, where."""
    engine, choice = opened.engine, opened.choice
    console.print(f"[bold]Backend:[/] {choice.backend.name}")
    for note in choice.notes:
        console.print(f"  {note}")
    console.print(f"[bold]Model:[/] {engine.model_name} ({opened.model.architecture})")
    if opened.model.is_demo:
        console.print(
            "  [yellow]demo has random weights: its text is meaningless[/] (it is for trying "
            "llmctl out; pass a model directory to serve a real model)"
        )
    stats = engine.stats()
    if stats.kv_blocks_total:
        cache = (
            f"{stats.kv_blocks_total} blocks x {stats.block_size} tokens = "
            f"{stats.kv_blocks_total * stats.block_size} tokens"
        )
    else:  # an engine that keeps no KV cache here (a proxy to another server)
        cache = "none in this process"
    session = f"{engine.max_model_len} tokens" if engine.max_model_len else "not known here"
    console.print(f"[bold]KV cache:[/] {cache}; session length {session}")
    auth = f"{len(options['api_keys'])} API key(s)" if options["api_keys"] else "none (open)"
    console.print(
        f"[bold]Limits:[/] {options['max_concurrent_requests']} concurrent requests, "
        f"{options['max_queued_requests']} queued; auth: {auth}"
    )
    console.print(f"[bold green]Serving on {url}[/]  (OpenAI base URL: {url}/v1)")
