"""Render ``docs/reference/options.md`` from the schema (``python -m llmctl.options_doc``)."""

from __future__ import annotations

import sys
from pathlib import Path

from llmctl.options import CORE_OPTIONS, Option, help_with_rules

REFERENCE_PATH = Path("docs/reference/options.md")


def _default(opt: Option) -> str:
    if opt.default is None:
        return "unset"
    if isinstance(opt.default, bool):
        return "`true`" if opt.default else "`false`"
    return f"`{opt.default}`"


def _allowed(opt: Option) -> str:
    if opt.choices:
        return ", ".join(f"`{c}`" for c in opt.choices)
    bounds = []
    if opt.min is not None:
        bounds.append(f">= {opt.min:g}")
    if opt.max is not None:
        bounds.append(f"<= {opt.max:g}")
    return " and ".join(bounds) or opt.kind


def render_options_reference() -> str:
    lines = [
        "# Option reference",
        "",
        "Generated from `llmctl/options.py` by `python -m llmctl.options_doc`; do not edit.",
        "",
        "Each option is a CLI flag, a TOML profile key and an environment variable. "
        "Resolution, highest first: flag, environment variable, the profile's section for "
        "the chosen backend, the profile's common keys, the backend's default, the default "
        "below. `llmctl config show --explain` prints each value with its source. Plugins "
        "may add options (see docs/plugins.md); they are not listed here.",
        "",
        "| option | flag | env | type | default | allowed | commands |",
        "|---|---|---|---|---|---|---|",
    ]
    for opt in CORE_OPTIONS:
        commands = ", ".join(sorted(opt.commands))
        flags = ", ".join(f"`{flag}`" for flag in (opt.flag, *opt.aliases))
        lines.append(
            f"| `{opt.name}` | {flags} | `{opt.env_var}` | {opt.kind} | {_default(opt)} "
            f"| {_allowed(opt)} | {commands} |"
        )
    lines += ["", "## Details", ""]
    for opt in CORE_OPTIONS:
        lines += [f"### `{opt.name}`", "", help_with_rules(opt), ""]
    return "\n".join(lines)


def main() -> None:
    """``python -m llmctl.options_doc [PATH]``: write the reference (default: the docs')."""
    args = sys.argv[1:]
    usage = f"usage: python -m llmctl.options_doc [PATH]  (default: {REFERENCE_PATH})"
    if args in (["-h"], ["--help"]):
        print(usage)
        return
    if len(args) > 1 or (args and args[0].startswith("-")):
        # A flag is never a file name: `--help` once wrote a file called `--help`.
        sys.exit(usage)
    target = Path(args[0]) if args else REFERENCE_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_options_reference())
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
