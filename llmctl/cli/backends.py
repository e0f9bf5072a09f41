"""``llmctl backends``: what is installed, what can serve a model here, and builds."""

from __future__ import annotations

from typing import Any

import typer

from llmctl.cli.output import console, styled, wrapping_table
from llmctl.cli.schema_flags import schema_options


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="List installed backends, check which can serve a model, build ahead of time.",
        invoke_without_command=True,
    )
    group.callback()(list_backends)
    group.command("check")(check)
    group.command("build")(build)
    app.add_typer(group, name="backends")


def list_backends(ctx: typer.Context) -> None:
    """List installed backends and whether each can run on this machine."""
    if ctx.invoked_subcommand is not None:
        return
    from llmctl.hardware import Hardware
    from llmctl.plugins.manager import get_plugin_manager, registered_backends
    from llmctl.profiles import selected_profile

    hardware = Hardware.probe()
    profile = selected_profile(None)
    table = wrapping_table(
        "backend",
        "distribution",
        "version",
        "priority",
        "CPU threads",
        "runs here",
        title="Backends",
    )
    for name, entry in registered_backends().items():
        reasons = entry.backend.check_hardware(hardware)
        runs = (
            styled(("yes", "green"))
            if not reasons
            else styled(("no", "red"), ": " + "; ".join(reasons))
        )
        table.add_row(
            name,
            entry.plugin.distribution,
            entry.plugin.version,
            str(entry.backend.priority),
            cpu_threads(entry.backend, profile),
            runs,
        )
    console.print(table)
    console.print(f"This machine: {hardware.describe()}")
    for failure in get_plugin_manager().failed:
        console.print(
            styled((f"plugin {failure.name} failed to load", "red"), f": {failure.error} — skipped")
        )


def cpu_threads(backend, profile) -> str:
    """The threads a local backend computes with on the CPU (the cpu_threads option as
    the profile, LLMCTL_CPU_THREADS or the backend set it, else torch's count) and where
    that comes from."""
    from llmctl.options import option_named
    from llmctl.profiles import describe_source, resolve

    if not backend.loads_local_model:
        return "-"
    setting = resolve(
        {},
        profile=profile,
        backend=backend.name,
        backend_defaults=backend.option_defaults,
        options=[option_named("cpu_threads")],
    )["cpu_threads"]
    if setting.value is not None:
        return f"{setting.value} ({describe_source(setting)})"
    try:
        import torch
    except ImportError:
        return "-"
    return f"{torch.get_num_threads()} (torch's default)"


@schema_options("backends check", skip=("model",))
def check(
    flags: dict[str, Any],
    model: str = typer.Argument(
        ...,
        help="Model: `smollm2-135m`, `demo`, a local directory, a GGUF file or a cached hub id.",
    ),
    profile: str | None = typer.Option(None, "--profile", "-p", help="Profile to use."),
) -> None:
    """For each backend: can it serve MODEL with these options here, and if not, why.

    Nothing is loaded; this answers before `serve` or `chat` would.
    """
    from llmctl.errors import BackendError
    from llmctl.hardware import Hardware
    from llmctl.profiles import selected_profile
    from llmctl.selection import (
        assess,
        candidates,
        first_that_serves,
        installed_backends,
        model_from_options,
    )

    flags = {**flags, "model": model}
    profile_obj = selected_profile(profile)
    requested, _ = candidates(flags, profile=profile_obj)
    info = model_from_options(flags, profile_obj)
    hardware = Hardware.probe()
    console.print(f"Model: {info.name} ({info.architecture}) at {info.path}")
    backends = installed_backends()
    verdicts = [assess(b, info, flags, profile_obj, hardware) for b in backends.values()]
    for verdict in verdicts:
        if verdict.reasons:
            console.print(styled((f"✗ {verdict.backend.name}", "red"), " cannot serve:"))
            for reason in verdict.reasons:
                console.print(f"    - {reason}")
        else:
            console.print(styled((f"✓ {verdict.backend.name}", "green"), " can serve"))
    # What `auto` (or the backend asked for) would do, from the verdicts above.
    asked = (
        verdicts if requested == "auto" else [v for v in verdicts if v.backend.name == requested]
    )
    try:
        choice = first_that_serves(asked, info, hardware, requested, backends)
    except BackendError as exc:
        console.print(styled(("No backend would be chosen:", "red"), f" {exc}"))
        raise typer.Exit(1) from None
    console.print(styled((f"--backend {requested} would pick {choice.backend.name}", "bold")))
    for note in choice.notes:
        console.print(f"  {note}")


def build(name: str = typer.Argument(..., help="Backend to build, e.g. turbo.")) -> None:
    """Build a backend's native parts ahead of time (otherwise they build on first use)."""
    from llmctl.errors import BackendError
    from llmctl.hardware import Hardware
    from llmctl.options import did_you_mean
    from llmctl.selection import installed_backends

    backends = installed_backends()
    if name not in backends:
        raise BackendError(f"unknown backend {name!r}.{did_you_mean(name, backends)}")
    summary = backends[name].prepare(Hardware.probe())
    console.print(summary or f"{name}: nothing to build")
