"""Turn the option schema into Typer flags, so no option is typed twice by hand.

``@schema_options("serve")`` adds one flag per schema option that the ``serve``
command takes. The command receives ``flags``: only the options given on the
command line, which is what resolution needs to tell a flag from a default.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from llmctl.options import Option, help_with_rules, options_for

COMMON_PANEL = "Common options"
ENGINE_PANEL = "Engine options"
SERVER_PANEL = "Server options"

# What `--help` lists: the options most runs touch. The rest show with --help-all (a
# full --help of serve was 380 lines, unreadable at 80 columns).
COMMON = frozenset(
    {
        "backend",
        "device",
        "dtype",
        "session_len",
        "cache_block_seq_len",
        "cache_max_entry_count",
        "quantization",
        "tensor_parallel_size",
        "host",
        "port",
        "api_keys",
    }
)
HELP_ALL = "--help-all"


def _annotation(opt: Option) -> Any:
    base = {
        "int": int,
        "float": float,
        "str": str,
        "bool": bool,
        "list": list[str],
        "map": list[str],  # NAME=VALUE, repeated
        "kv_budget": str,
    }[opt.kind]
    if opt.kind == "bool":
        decls = [f"{opt.flag}/--no-{opt.flag[2:]}"]
    else:
        decls = [opt.flag, *opt.aliases]
    default = "" if opt.default is None else f" [default: {_show(opt.default)}]"
    info = typer.Option(
        *decls,
        # Typer reads help as rich markup: escaped, "[default: 64]" shows instead of
        # vanishing as an unknown tag (and a plugin's help cannot break the page).
        help=escape(f"{help_with_rules(opt)}{default} (env {opt.env_var})"),
        metavar=opt.metavar,
        show_default=False,
        hidden=opt.name not in COMMON,
        rich_help_panel=_panel(opt),
    )
    return Annotated[Optional[base], info]  # noqa: UP045 - typer needs Optional at runtime


def _panel(opt: Option) -> str:
    if opt.name in COMMON:
        return COMMON_PANEL
    return SERVER_PANEL if "serve" in opt.commands and "chat" not in opt.commands else ENGINE_PANEL


def _help_all(ctx: typer.Context, value: bool) -> None:
    """``--help-all``: the command's help with every option, then exit."""
    if not value or ctx.resilient_parsing:
        return
    for param in ctx.command.params:
        param.hidden = False
    text = ctx.command.get_help(ctx)  # rich help prints itself and returns ""
    if text:
        typer.echo(text)
    raise typer.Exit()


HELP_ALL_PARAMETER = inspect.Parameter(
    "help_all",
    inspect.Parameter.KEYWORD_ONLY,
    default=False,
    annotation=Annotated[
        bool,
        typer.Option(
            HELP_ALL,
            callback=_help_all,
            is_eager=True,
            metavar="",
            help="Show every option: --help lists the common ones.",
        ),
    ],
)


def _fold_flag_names() -> None:
    """typer's help cuts a long flag short in a narrow terminal (``--cache-block-seq-l…``,
    which hid the ``--tp`` alias); its highlighters build each name's Text, so marking
    that Text to fold wraps the name onto the next line instead."""
    from typer import rich_utils

    for highlighter in (rich_utils.highlighter, rich_utils.negative_highlighter):
        paint = highlighter.highlight

        def highlight(text: Any, paint: Callable = paint) -> None:
            text.overflow = "fold"
            paint(text)

        highlighter.highlight = highlight  # type: ignore[method-assign]


_fold_flag_names()


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def schema_options(command: str, *, skip: tuple[str, ...] = ()) -> Callable:
    """Decorate a command function that takes ``flags: dict``; add the schema's flags."""

    def decorate(fn: Callable) -> Callable:
        hints = typing.get_type_hints(fn, include_extras=True)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(fn).parameters.values()
            if p.name != "flags"
        ]
        taken = {p.name for p in own} | set(skip)
        schema = [opt for opt in options_for(command) if opt.name not in taken]
        extra = [
            inspect.Parameter(
                opt.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_annotation(opt)
            )
            for opt in schema
        ]

        def command_with_flags(**kwargs: Any) -> Any:
            kwargs.pop(HELP_ALL_PARAMETER.name)  # handled by its callback
            flags = {}
            for opt in schema:
                value = kwargs.pop(opt.name)
                if value is not None and not (opt.kind in ("list", "map") and value == []):
                    flags[opt.name] = value
            return fn(flags=flags, **kwargs)

        command_with_flags.__name__ = fn.__name__
        command_with_flags.__doc__ = fn.__doc__
        command_with_flags.__module__ = fn.__module__
        params = [*own, HELP_ALL_PARAMETER, *extra]
        command_with_flags.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command_with_flags.__annotations__ = {p.name: p.annotation for p in params}
        return command_with_flags

    return decorate
