"""The ``llmctl`` command: a Typer app with one module per command group.

Importing this module must stay cheap (no torch): commands import heavy parts
inside their bodies.
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from llmctl import __version__
from llmctl.cli import backends, config, plugins, profiles
from llmctl.errors import LlmctlError

app = typer.Typer(
    name="llmctl",
    help="Serve and chat with large language models through swappable inference backends.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmctl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        metavar="",
        help="Print the version and exit.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", metavar="", help="Log debug details."),
) -> None:
    """Serve and chat with large language models through swappable inference backends."""
    setup_logging(logging.DEBUG if verbose else logging.INFO)
    from llmctl.options import unknown_env_vars

    for warning in unknown_env_vars(os.environ):
        logging.getLogger("llmctl").warning(warning)


def setup_logging(level: int) -> None:
    """Log lines from llmctl (backend choice, KV plan, ...) to stderr through rich."""
    from rich.console import Console
    from rich.logging import RichHandler

    logger = logging.getLogger("llmctl")
    if not logger.handlers:
        console = Console(stderr=True)
        if console.is_terminal:
            handler: logging.Handler = RichHandler(
                console=console, show_path=False, show_time=False, markup=False
            )
        else:  # a file or a pipe: whole lines, never wrapped at a made-up width
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)


def _register_commands() -> None:
    backends.register(app)
    config.register(app)
    profiles.register(app)
    plugins.register(app)
    for name in ("serve", "chat", "bench", "models"):
        _register_optional(name)
    from llmctl.plugins.manager import get_plugin_manager

    get_plugin_manager().manager.hook.llmctl_register_commands(cli=app)


def _register_optional(name: str) -> None:
    """Command modules that other parts of llmctl add; absent ones are simply not listed."""
    import importlib

    try:
        module = importlib.import_module(f"llmctl.cli.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"llmctl.cli.{name}":
            raise
        return
    module.register(app)


_register_commands()


def run() -> None:
    """Console-script entry point: user errors become one paragraph, never a traceback."""
    try:
        app()
    except LlmctlError as exc:
        from llmctl.cli.output import err_console, styled

        err_console.print(styled(("Error:", "bold red"), f" {exc}"), soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    run()
