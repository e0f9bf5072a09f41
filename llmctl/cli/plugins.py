"""``llmctl plugins``: which plugins loaded, what hooks they implement, which failed."""

from __future__ import annotations

import typer

from llmctl.cli.output import console, styled, wrapping_table


def register(app: typer.Typer) -> None:
    app.command("plugins")(list_plugins)


def list_plugins() -> None:
    """List installed plugins (entry-point group `llmctl`) and the hooks each implements."""
    from llmctl.plugins.manager import allowed_plugin_names, get_plugin_manager

    plugins = get_plugin_manager()
    table = wrapping_table("plugin", "distribution", "version", "module", "hooks", title="Plugins")
    for info in plugins.loaded:
        table.add_row(
            info.name, info.distribution, info.version, info.module, ", ".join(info.hooks)
        )
    console.print(table)
    allowed = allowed_plugin_names()
    if allowed is not None:
        console.print(f"LLMCTL_PLUGINS restricts loading to: {', '.join(sorted(allowed))}")
    for failure in plugins.failed:
        console.print(
            styled(
                ("failed", "red"),
                f" {failure.name} ({failure.distribution}): {failure.error} — skipped",
            )
        )
