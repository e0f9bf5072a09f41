"""TOML profiles and value resolution, keeping the source of every value.

A profile file holds ``[profiles.NAME]`` tables of option keys, and optional
``[profiles.NAME.BACKEND]`` sub-tables used only when that backend is chosen.
Resolution, highest first: CLI flag, ``LLMCTL_*`` env var, the profile's section for
the chosen backend, the profile's common keys, the backend's default, the schema default.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from llmctl.errors import OptionError, ProfileError
from llmctl.options import Option, all_options, did_you_mean, unknown_key_message
from llmctl.paths import config_dir
from llmctl.plugins.manager import registered_backends

PROFILE_FILE_NAME = "llmctl.toml"


class Source(IntEnum):
    """Where a value came from; a higher number wins."""

    DEFAULT = 1
    BACKEND_DEFAULT = 2
    PROFILE = 3
    PROFILE_BACKEND = 4
    ENV = 5
    FLAG = 6


class Keywords(dict):
    """Options given as keyword arguments of ``LLM(...)``: they rank as flags (the caller
    set them) but are reported as what they are, ``LLM(name=...)``, not as a flag."""


@dataclass(frozen=True)
class Setting:
    value: Any
    source: Source
    detail: str  # human-readable origin, e.g. "llmctl.toml:4 [profiles.small.turbo]"
    label: str | None = None  # what the source is called, when not the Source's usual name

    @property
    def explicit(self) -> bool:
        """Set by the user (flag, env or profile) rather than a default."""
        return self.source >= Source.PROFILE


@dataclass
class Profile:
    name: str
    file: Path
    common: dict[str, Any]
    backend_sections: dict[str, dict[str, Any]]
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)

    def where(self, *table_and_key: str) -> str:
        line = self.lines.get(table_and_key)
        return f"{self.file}:{line}" if line else str(self.file)


def profile_search_path() -> list[Path]:
    """``./llmctl.toml`` first, then the user config dir's ``llmctl.toml``."""
    return [Path.cwd() / PROFILE_FILE_NAME, config_dir() / PROFILE_FILE_NAME]


def load_profiles(paths: Iterable[Path] | None = None) -> dict[str, Profile]:
    """All profiles of the existing files; a name in an earlier file wins."""
    profiles: dict[str, Profile] = {}
    for path in profile_search_path() if paths is None else paths:
        if path.is_file():
            for name, profile in read_profile_file(path).items():
                profiles.setdefault(name, profile)
    return profiles


def get_profile(name: str, paths: Iterable[Path] | None = None) -> Profile:
    searched = profile_search_path() if paths is None else list(paths)
    profiles = load_profiles(searched)
    if name not in profiles:
        known = ", ".join(sorted(profiles)) or "none"
        raise ProfileError(
            f"profile {name!r} not found.{did_you_mean(name, profiles)} Known profiles: "
            f"{known}. Looked in: {', '.join(str(p) for p in searched)}"
        )
    return profiles[name]


def read_profile_file(path: Path) -> dict[str, Profile]:
    """Parse and validate one file; every problem names the file, line and key."""
    text = _read_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: malformed TOML: {exc}") from None
    lines = _key_lines(text)
    unknown_top = [key for key in data if key != "profiles"]
    if unknown_top:
        raise ProfileError(
            f"{path}:{lines.get((unknown_top[0],), '?')}: unknown top-level key "
            f"{unknown_top[0]!r}: profiles go in [profiles.NAME] tables"
        )
    tables = data.get("profiles", {})
    if not isinstance(tables, dict):
        raise ProfileError(f"{path}: `profiles` must be a table of [profiles.NAME] tables")
    options = {opt.name: opt for opt in all_options()}
    backend_names = set(registered_backends())
    profiles = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ProfileError(
                f"{path}:{lines.get(('profiles', name), '?')}: profiles.{name} must be a table"
            )
        common: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for key, value in table.items():
            if isinstance(value, dict) and not _is_map(options, key):
                if key not in backend_names:
                    raise ProfileError(
                        f"{path}:{lines.get(('profiles', name, key), '?')}: "
                        f"[profiles.{name}.{key}] names no installed backend."
                        f"{did_you_mean(key, backend_names)} Backend sections must be one "
                        f"of: {', '.join(sorted(backend_names)) or 'none installed'}"
                    )
                sections[key] = {
                    k: _check_key(options, path, lines, (name, key), k, v) for k, v in value.items()
                }
            else:
                common[key] = _check_key(options, path, lines, (name,), key, value)
        profiles[name] = Profile(name, path, common, sections, _profile_lines(lines, name))
    return profiles


def _check_key(
    options: Mapping[str, Option],
    path: Path,
    lines: Mapping[tuple[str, ...], int],
    table: tuple[str, ...],
    key: str,
    value: Any,
) -> Any:
    location = f"{path}:{lines.get(('profiles', *table, key), '?')}"
    header = "profiles." + ".".join(table)
    if key not in options:
        raise ProfileError(unknown_key_message(key, location, within=f" in [{header}]"))
    if isinstance(value, dict) and options[key].kind != "map":
        raise ProfileError(f"{location}: {key} in [{header}] must be a value, not a table")
    try:
        return options[key].convert(value, f"{location} [{header}]")
    except OptionError as exc:
        raise ProfileError(str(exc)) from None


def _is_map(options: Mapping[str, Option], key: str) -> bool:
    """A table that is an option's value (``[profiles.P.lora]``), not a backend section."""
    return key in options and options[key].kind == "map"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read profile file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path} is not UTF-8 text") from None


# A table header or a key, bare or quoted (a quoted name may hold brackets: "a[v2]").
_HEADER = re.compile(r"^\s*\[(?!\[)\s*(.+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(r"""^\s*((?:"[^"]*"|'[^']*'|[A-Za-z0-9_\-. ])+?)\s*=""")


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map (table..., key) to its line number, for error messages (tomllib keeps none)."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        if header := _HEADER.match(line):
            table = _dotted(header.group(1))
            lines.setdefault(table, number)
        elif key := _KEY.match(line):
            lines.setdefault(table + _dotted(key.group(1)), number)
    return lines


def _dotted(name: str) -> tuple[str, ...]:
    """The parts of a dotted TOML name, quotes removed (``profiles."a.b"`` has two)."""
    parts = re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", name)
    return tuple(part.strip().strip("\"'") for part in parts)


def _profile_lines(lines: Mapping[tuple[str, ...], int], name: str) -> dict[tuple[str, ...], int]:
    return {key[2:]: n for key, n in lines.items() if key[:2] == ("profiles", name)}


# --- resolution -------------------------------------------------------------------------


def resolve(
    flags: Mapping[str, Any],
    *,
    profile: Profile | None = None,
    backend: str | None = None,
    backend_defaults: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    options: Iterable[Option] | None = None,
) -> dict[str, Setting]:
    """Every option's winning value and its source, for the given backend (if any).

    ``flags`` holds only options given on the command line (already converted).
    """
    env = os.environ if env is None else env
    backend_defaults = backend_defaults or {}
    section = profile.backend_sections.get(backend, {}) if profile and backend else {}
    settings = {}
    for opt in all_options() if options is None else options:
        name = opt.name
        if name in flags and flags[name] is not None and isinstance(flags, Keywords):
            where = f"LLM({name}=...)"
            value = opt.convert(flags[name], where)
            setting = Setting(value, Source.FLAG, where, label="keyword argument")
        elif name in flags and flags[name] is not None:
            setting = Setting(opt.convert(flags[name], f"flag {opt.flag}"), Source.FLAG, opt.flag)
        elif opt.env_var in env:
            value = opt.convert(env[opt.env_var], f"environment variable {opt.env_var}", text=True)
            setting = Setting(value, Source.ENV, opt.env_var)
        elif name in section:
            where = f"{profile.where(backend, name)} [profiles.{profile.name}.{backend}]"
            setting = Setting(section[name], Source.PROFILE_BACKEND, where)
        elif profile and name in profile.common:
            where = f"{profile.where(name)} [profiles.{profile.name}]"
            setting = Setting(profile.common[name], Source.PROFILE, where)
        elif name in backend_defaults:
            value = opt.convert(backend_defaults[name], f"backend {backend} default")
            setting = Setting(value, Source.BACKEND_DEFAULT, f"{backend} default")
        else:
            setting = Setting(opt.convert(opt.default, "schema default"), Source.DEFAULT, "")
        settings[name] = setting
    return settings


def selected_profile(name: str | None, env: Mapping[str, str] | None = None) -> Profile | None:
    """The profile named by ``--profile`` or ``LLMCTL_PROFILE``, if any."""
    env = os.environ if env is None else env
    name = name or env.get("LLMCTL_PROFILE")
    return get_profile(name) if name else None


def describe_source(setting: Setting) -> str:
    label = {
        Source.FLAG: "flag",
        Source.ENV: "env",
        Source.PROFILE_BACKEND: "profile section",
        Source.PROFILE: "profile",
        Source.BACKEND_DEFAULT: "backend default",
        Source.DEFAULT: "schema default",
    }[setting.source]
    label = setting.label or label
    return f"{label} ({setting.detail})" if setting.detail else label
