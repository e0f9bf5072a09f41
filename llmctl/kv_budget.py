"""``cache_max_entry_count``: how much memory the KV cache may take, in one of three forms.

- a fraction of the memory free when the engine starts: ``0.8``, ``"0.8"`` or ``"80%"``
  (a number with a decimal point or a percent sign);
- an absolute size: ``"4GiB"``, ``"512MiB"``, ``"2GB"`` (a number with a unit);
- a number of blocks: ``2000`` or ``"2000"`` (a plain integer).

The forms cannot be confused: ``"1"`` is one block, ``"1.0"`` is all free memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)\s*$", re.IGNORECASE)

FORMS_HELP = "a fraction of free memory (0.8 or 80%), a size (4GiB, 512MiB) or a block count (2000)"


@dataclass(frozen=True)
class KVBudget:
    kind: str  # "fraction" | "bytes" | "blocks"
    value: float

    def num_blocks(self, bytes_per_block: int, free_bytes: int) -> int:
        """Blocks this budget buys, given one block's size and the memory free now."""
        if self.kind == "blocks":
            return int(self.value)
        budget = self.value * free_bytes if self.kind == "fraction" else self.value
        return int(budget // bytes_per_block)

    def __str__(self) -> str:
        if self.kind == "fraction":
            return f"{self.value:g} of free memory"
        if self.kind == "bytes":
            return format_bytes(self.value)
        return f"{int(self.value)} blocks"


def parse_kv_budget(value: object) -> KVBudget:
    """Parse any of the three forms; raise ``ValueError`` naming the accepted forms."""
    if isinstance(value, KVBudget):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected {FORMS_HELP}, got {value!r}")
    if isinstance(value, int):
        return _blocks(value)
    if isinstance(value, float):
        return _fraction(value)
    text = str(value).strip()
    if re.fullmatch(r"\d+", text):
        return _blocks(int(text))
    if text.endswith("%"):
        try:
            return _fraction(float(text[:-1]) / 100)
        except ValueError:
            pass
    elif re.fullmatch(r"\d*\.\d+|\d+\.\d*", text):
        return _fraction(float(text))
    elif match := _SIZE.match(text):
        size = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if size <= 0:
            raise ValueError(f"a KV-cache size must be positive, got {text!r}")
        return KVBudget("bytes", size)
    raise ValueError(f"expected {FORMS_HELP}, got {value!r}")


def _blocks(count: int) -> KVBudget:
    if count < 1:
        raise ValueError(f"a KV-cache block count must be at least 1, got {count}")
    return KVBudget("blocks", count)


def _fraction(fraction: float) -> KVBudget:
    if not 0 < fraction <= 1:
        raise ValueError(
            f"a fraction of free memory must be in (0, 1], got {fraction:g} "
            "(for a number of blocks write an integer, for a size add a unit such as GiB)"
        )
    return KVBudget("fraction", fraction)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
