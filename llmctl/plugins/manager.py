"""Find plugins under the ``llmctl`` entry-point group and load them safely.

A plugin that fails to import or register is recorded with its error and skipped:
the CLI must keep working whatever a third-party package does. Loading is
idempotent, so calling it again in another process or thread is harmless.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

import pluggy

from llmctl.plugins import hookspecs

if TYPE_CHECKING:
    from llmctl.backend import Backend

ENTRY_POINT_GROUP = "llmctl"


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str
    hooks: list[str] = field(default_factory=list)


@dataclass
class PluginFailure:
    name: str
    distribution: str
    error: str


@dataclass
class BackendEntry:
    backend: Backend
    plugin: PluginInfo


@dataclass
class Plugins:
    manager: pluggy.PluginManager
    loaded: list[PluginInfo]
    failed: list[PluginFailure]
    backends: dict[str, BackendEntry] = field(default_factory=dict)


_lock = threading.Lock()
_plugins: Plugins | None = None


def get_plugin_manager() -> Plugins:
    """The loaded plugins (loaded once per process)."""
    global _plugins
    with _lock:
        if _plugins is None:
            _plugins = _load()
        return _plugins


def registered_backends() -> dict[str, BackendEntry]:
    """Backends by name, highest priority first, each with the plugin that registered it."""
    return get_plugin_manager().backends


def allowed_plugin_names() -> set[str] | None:
    """``LLMCTL_PLUGINS=a,b`` restricts loading to those names; unset means all."""
    raw = os.environ.get("LLMCTL_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _load() -> Plugins:
    manager = pluggy.PluginManager("llmctl")
    manager.add_hookspecs(hookspecs)
    allowed = allowed_plugin_names()
    loaded: list[PluginInfo] = []
    failed: list[PluginFailure] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if allowed is not None and ep.name not in allowed:
            continue
        if manager.has_plugin(ep.name):  # two distributions claiming one name: first wins
            continue
        dist_name, version = _distribution(ep)
        try:
            module = ep.load()
            manager.register(module, name=ep.name)
        except Exception as exc:  # a broken plugin must not break llmctl
            failed.append(PluginFailure(ep.name, dist_name, f"{type(exc).__name__}: {exc}"))
            continue
        hooks = sorted(h.name for h in manager.get_hookcallers(module) or [])
        loaded.append(PluginInfo(ep.name, dist_name, version, ep.value, hooks))
    plugins = Plugins(manager, loaded, failed)
    _register_backends(plugins)
    return plugins


def _register_backends(plugins: Plugins) -> None:
    """Call each plugin's backend hook on its own, so a failure names the plugin."""
    by_name = {info.name: info for info in plugins.loaded}
    found: list[BackendEntry] = []
    for impl in plugins.manager.hook.llmctl_register_backends.get_hookimpls():
        info = by_name.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "?", "?")
        classes: list[type[Backend]] = []
        try:
            impl.function(register=classes.append)
            found += [BackendEntry(cls(), info) for cls in classes]
        except Exception as exc:  # a broken plugin must not break llmctl
            plugins.failed.append(
                PluginFailure(info.name, info.distribution, f"{type(exc).__name__}: {exc}")
            )
    for entry in sorted(found, key=lambda e: -e.backend.priority):
        plugins.backends.setdefault(entry.backend.name, entry)


def _distribution(ep: EntryPoint) -> tuple[str, str]:
    dist = ep.dist
    if dist is None:
        return "unknown", "unknown"
    return dist.metadata["Name"], dist.version
