"""Shared terminal output: one rich console for tables and messages.

Neither console reads markup: model names, paths, profile keys and error messages hold
brackets (``[profiles.x]``, ``models[v2]``, ``[/]``) that rich would take for tags, eat
or crash on. Styled text is built from parts with ``styled``, so only llmctl's own
words carry a style and nothing a user wrote is ever parsed.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

console = Console(highlight=False, markup=False)
err_console = Console(stderr=True, highlight=False, markup=False)


def styled(*parts: str | tuple[str, str]) -> Text:
    """One piece of text from plain strings and ``(text, style)`` pairs, taken literally."""
    return Text.assemble(*parts)


def wrapping_table(*headers: str, **options: object) -> Table:
    """A table whose cells wrap, and fold a long word (a path, a hook name) over lines:
    a name is never cut short with an ellipsis, whatever the terminal's width."""
    rendered = Table(**options)
    for header in headers:
        rendered.add_column(header, overflow="fold")
    return rendered
