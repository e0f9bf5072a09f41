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

ENGINE_PANEL = "Engine options"
SERVER_PANEL = "Server options"


def _annotation(opt: Option) -> Any:
    base = {
        "int": int,
        "float": float,
        "str": str,
        "bool": bool,
        "list": list[str],
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
        rich_help_panel=SERVER_PANEL
        if "serve" in opt.commands and "chat" not in opt.commands
        else ENGINE_PANEL,
    )
    return Annotated[Optional[base], info]  # noqa: UP045 - typer needs Optional at runtime


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
            flags = {}
            for opt in schema:
                value = kwargs.pop(opt.name)
                if value is not None and not (opt.kind == "list" and value == []):
                    flags[opt.name] = value
            return fn(flags=flags, **kwargs)

        command_with_flags.__name__ = fn.__name__
        command_with_flags.__doc__ = fn.__doc__
        command_with_flags.__module__ = fn.__module__
        params = own + extra
        command_with_flags.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command_with_flags.__annotations__ = {p.name: p.annotation for p in params}
        return command_with_flags

    return decorate
