"""``llmctl profiles``: list, show and validate TOML profiles."""

from __future__ import annotations

from pathlib import Path

import typer

from llmctl.cli.output import console, styled, wrapping_table


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="List, show and validate TOML profiles.", no_args_is_help=True)
    group.command("list")(list_profiles)
    group.command("show")(show_profile)
    group.command("validate")(validate)
    app.add_typer(group, name="profiles")


def list_profiles() -> None:
    """List the profiles found in ./llmctl.toml and the user config dir."""
    from llmctl.profiles import load_profiles, profile_search_path

    profiles = load_profiles()
    table = wrapping_table(
        "profile", "model", "backend", "backend sections", "file", title="Profiles"
    )
    for profile in profiles.values():
        table.add_row(
            profile.name,
            str(profile.common.get("model", "-")),
            str(profile.common.get("backend", "-")),
            ", ".join(profile.backend_sections) or "-",
            str(profile.file),
        )
    console.print(table)
    if not profiles:
        searched = ", ".join(str(p) for p in profile_search_path())
        console.print(f"No profiles found. Looked in: {searched}")


def show_profile(name: str = typer.Argument(..., help="Profile name.")) -> None:
    """Show one profile's keys, and its per-backend sections."""
    from llmctl.profiles import get_profile

    profile = get_profile(name)
    table = wrapping_table(
        "section", "key", "value", "line", title=f"profile {name} ({profile.file})"
    )
    for key, value in profile.common.items():
        table.add_row(f"profiles.{name}", key, str(value), profile.where(key))
    for backend, section in profile.backend_sections.items():
        for key, value in section.items():
            table.add_row(
                f"profiles.{name}.{backend}", key, str(value), profile.where(backend, key)
            )
    console.print(table)


def validate(
    file: Path | None = typer.Argument(
        None, help="Profile file to check (default: every file in the search path)."
    ),
) -> None:
    """Check profile files: syntax, known keys, types and ranges. Exit 1 on the first error."""
    from llmctl.errors import ProfileError
    from llmctl.profiles import profile_search_path, read_profile_file

    files = [file] if file else [p for p in profile_search_path() if p.is_file()]
    if file and not file.is_file():
        raise ProfileError(f"profile file {file} does not exist")
    if not files:
        console.print("No profile files found; nothing to validate.")
        return
    for path in files:
        profiles = read_profile_file(path)
        console.print(
            styled(("OK", "green"), f" {path}: {len(profiles)} profile(s): {', '.join(profiles)}")
        )
