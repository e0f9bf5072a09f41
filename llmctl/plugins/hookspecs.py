"""The hooks a plugin may implement. A plugin is a module exposed under the ``llmctl``
entry-point group; it marks its functions with ``llmctl.hookimpl``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import typer

    from llmctl.backend import Backend

hookspec = pluggy.HookspecMarker("llmctl")
hookimpl = pluggy.HookimplMarker("llmctl")


@hookspec
def llmctl_register_backends(register: Callable[[type[Backend]], Any]) -> None:
    """Register backend classes: call ``register(MyBackend)`` once per backend.

    Keep the module light: import torch and other heavy packages inside the
    backend's methods, not at the top of the plugin module, so ``llmctl --help``
    stays fast.
    """


@hookspec
def llmctl_register_options(register: Callable[[Any], Any]) -> None:
    """Add options to the schema: call ``register(Option(...))`` for each (``Option`` is
    ``llmctl.options.Option``; not imported here, since the schema loads the plugins).

    They become CLI flags of the commands they name, TOML profile keys and
    ``LLMCTL_*`` environment variables, exactly like the core's options.
    """


@hookspec
def llmctl_register_commands(cli: typer.Typer) -> None:
    """Add commands to the ``llmctl`` command line: ``@cli.command()`` or ``cli.add_typer``."""
