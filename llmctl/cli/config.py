"""``llmctl config show``: every resolved option, and with --explain where it came from."""

from __future__ import annotations

from typing import Any

import typer

from llmctl.cli.output import console, wrapping_table
from llmctl.cli.schema_flags import schema_options


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Show the configuration llmctl would use.", no_args_is_help=True)
    group.command("show")(show)
    app.add_typer(group, name="config")


@schema_options("config")
def show(
    flags: dict[str, Any],
    profile: str | None = typer.Option(
        None, "--profile", "-p", help="Profile to use (else LLMCTL_PROFILE)."
    ),
    explain: bool = typer.Option(False, "--explain", help="Show where each value came from."),
) -> None:
    """Print every option's resolved value for the backend that would be used.

    With `--backend auto` (the default) the backend is the one `auto` would choose for
    the model; pass `--backend NAME` to see another backend's view.
    """
    from llmctl.errors import LlmctlError
    from llmctl.hardware import Hardware
    from llmctl.options import all_options
    from llmctl.profiles import describe_source, resolve, selected_profile
    from llmctl.selection import AUTO, candidates, choose, model_from_options

    profile_obj = selected_profile(profile)
    requested, tried = candidates(flags, profile=profile_obj)
    hardware = Hardware.probe()
    note = ""
    backend = None
    passed_over: list[str] = []  # why auto did not take the backends before its choice
    if requested == AUTO:
        try:
            info = model_from_options(flags, profile_obj)
            choice = choose(info, flags, profile=profile_obj, hardware=hardware)
            settings, backend = choice.settings, choice.backend
            note = f"backend: auto chooses {choice.backend.name} for {info.name}"
            passed_over = [
                f"  {s.backend.name} passed over: {'; '.join(s.reasons)}" for s in choice.skipped
            ]
        except LlmctlError as exc:
            settings = resolve(flags, profile=profile_obj)
            note = f"backend: auto cannot choose yet ({exc}); showing values without a backend"
    else:
        backend = tried[0]
        settings = resolve(
            flags,
            profile=profile_obj,
            backend=backend.name,
            backend_defaults=backend.option_defaults,
        )
    # What a value does on this backend and machine when that is not what it seems
    # (cuda_graphs on the CPU: ignored).
    effects = (
        backend.option_notes({name: s.value for name, s in settings.items()}, hardware)
        if backend is not None and explain
        else {}
    )
    title = f"profile {profile_obj.name}" if profile_obj else "no profile"
    table = wrapping_table("option", "value", title=f"llmctl configuration ({title})")
    if explain:
        table.add_column("source", overflow="fold")
    secret = {opt.name for opt in all_options() if opt.secret}
    for name, setting in settings.items():
        shown = _format(setting.value)
        row = [name, "****" if name in secret and setting.value else shown]
        if explain:
            effect = f"; {backend.name}: {effects[name]}" if name in effects else ""
            row.append(describe_source(setting) + effect)
        table.add_row(*row)
    console.print(table)
    if note:
        console.print(note, soft_wrap=True)
    if explain:
        for line in passed_over:
            console.print(line, soft_wrap=True)


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(value) or "-"
    return str(value)
