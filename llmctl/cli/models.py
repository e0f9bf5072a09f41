"""``llmctl models``: the models llmctl can use here without downloading anything."""

from __future__ import annotations

import typer
from rich.table import Table

from llmctl.cli.output import console


def register(app: typer.Typer) -> None:
    app.command("models")(list_models)


def list_models() -> None:
    """List `demo` and the models in the local Hugging Face cache, with their architecture
    and the installed backends that support it."""
    from llmctl.errors import ModelError
    from llmctl.model_info import hf_hub_cache, resolve_model
    from llmctl.selection import installed_backends

    backends = installed_backends().values()
    names = ["demo"]
    cache = hf_hub_cache()
    if cache.is_dir():
        names += sorted(
            p.name.removeprefix("models--").replace("--", "/")
            for p in cache.iterdir()
            if p.name.startswith("models--")
        )
    table = Table("model", "architecture", "backends that support it", "path", title="Models")
    for name in names:
        try:
            info = resolve_model(name)
        except ModelError as exc:
            table.add_row(name, "-", f"[red]unusable[/]: {exc}", "-")
            continue
        supporting = [
            b.name
            for b in backends
            if b.loads_local_model
            and (
                b.supported_architectures is None or info.architecture in b.supported_architectures
            )
        ]
        label = f"{name} (random weights)" if info.is_demo else name
        table.add_row(label, info.architecture, ", ".join(supporting) or "none", str(info.path))
    console.print(table)
    console.print(f"Hugging Face cache: {cache}. Local directories work too: llmctl serve PATH")
