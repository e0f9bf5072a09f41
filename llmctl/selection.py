"""``--backend auto``: rank installed backends, check each, fall back, and say why.

Rules (DESIGN.md): backends are tried by priority; each one skipped gets a log line
with its reasons. A value the user set explicitly is never changed: if the backend
that would serve refuses it, that is an error naming the option, value, backend and
rule. Defaults are resolved per backend, so a fallback gets its own defaults.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.errors import BackendError
from llmctl.model_info import resolve_model
from llmctl.options import did_you_mean
from llmctl.profiles import Profile, Setting, describe_source, resolve, selected_profile

log = logging.getLogger("llmctl")

AUTO = "auto"


def installed_backends() -> dict[str, Backend]:
    """Backends registered by the loaded plugins, by name, highest priority first."""
    from llmctl.plugins.manager import registered_backends

    return {name: entry.backend for name, entry in registered_backends().items()}


@dataclass
class Assessment:
    """One backend's verdict: its resolved settings and why it cannot serve (if so)."""

    backend: Backend
    settings: dict[str, Setting]
    reasons: list[str]
    refused_explicit: dict[str, str] = field(default_factory=dict)  # option -> rule

    @property
    def values(self) -> dict[str, Any]:
        return {name: s.value for name, s in self.settings.items()}


@dataclass
class Choice:
    backend: Backend
    settings: dict[str, Setting]
    skipped: list[Assessment]
    notes: list[str]

    @property
    def values(self) -> dict[str, Any]:
        return {name: s.value for name, s in self.settings.items()}


def assess(
    backend: Backend,
    model: ModelInfo,
    flags: Mapping[str, Any],
    profile: Profile | None,
    hardware: Hardware,
    env: Mapping[str, str] | None = None,
) -> Assessment:
    settings = resolve(
        flags,
        profile=profile,
        backend=backend.name,
        backend_defaults=backend.option_defaults,
        env=env,
    )
    values = {name: s.value for name, s in settings.items()}
    try:
        refused = backend.option_errors(values, hardware)
        reasons = backend.check(model, values, hardware)
    except Exception as exc:  # a third-party backend's bug must not crash the CLI
        log.debug("backend %s check failed", backend.name, exc_info=True)
        refused, reasons = {}, [f"its check failed: {type(exc).__name__}: {exc}"]
    explicit = {name: rule for name, rule in refused.items() if settings[name].explicit}
    return Assessment(backend, settings, reasons, explicit)


def choose(
    model: ModelInfo,
    flags: Mapping[str, Any],
    *,
    profile: Profile | None = None,
    hardware: Hardware,
    backends: Mapping[str, Backend] | None = None,
    env: Mapping[str, str] | None = None,
) -> Choice:
    """Pick the backend that serves ``model``, or raise BackendError saying why none can."""
    backends = installed_backends() if backends is None else backends
    requested = resolve(flags, profile=profile, env=env)["backend"].value
    if not backends:
        raise BackendError(
            "no backend is installed: install one, e.g. `pip install llmctl-torch`, "
            "then check with `llmctl backends`"
        )
    if requested != AUTO and requested not in backends:
        raise BackendError(
            f"unknown backend {requested!r}.{did_you_mean(requested, backends)} Installed: "
            f"{', '.join(backends)} (or `auto`). See `llmctl backends`."
        )
    candidates = list(backends.values()) if requested == AUTO else [backends[requested]]
    skipped: list[Assessment] = []
    for backend in candidates:
        verdict = assess(backend, model, flags, profile, hardware, env)
        if not verdict.reasons:
            notes = [f"{s.backend.name} skipped: {'; '.join(s.reasons)}" for s in skipped]
            notes += _fallback_notes(skipped, verdict)
            return Choice(backend, verdict.settings, skipped, notes)
        skipped.append(verdict)
    raise BackendError(_no_backend_message(model, requested, skipped, backends))


def _fallback_notes(skipped: list[Assessment], chosen: Assessment) -> list[str]:
    """Say which defaulted values differ on the backend we fell back to."""
    notes = []
    for earlier in skipped:
        for name, setting in chosen.settings.items():
            before = earlier.settings[name]
            if not setting.explicit and setting.value != before.value:
                notes.append(
                    f"{name}: {chosen.backend.name} uses {setting.value!r} "
                    f"({describe_source(setting)}) instead of {earlier.backend.name}'s "
                    f"{before.value!r}"
                )
    return notes


def _no_backend_message(
    model: ModelInfo, requested: str, tried: list[Assessment], backends: Mapping[str, Backend]
) -> str:
    last = tried[-1]
    if last.refused_explicit:
        name, rule = next(iter(last.refused_explicit.items()))
        setting = last.settings[name]
        return (
            f"backend {last.backend.name} cannot use {name}={setting.value!r} "
            f"(set by {describe_source(setting)}): {rule}. llmctl never changes a value you "
            f"set: choose a value {last.backend.name} accepts, or remove the setting."
            + _other_reasons(tried)
        )
    lines = [f"no backend can serve {model.name} here:"]
    lines += [f"  {a.backend.name}: {'; '.join(a.reasons)}" for a in tried]
    if requested != AUTO:
        others = [name for name in backends if name != requested]
        alternatives = " or ".join(f"--backend {n}" for n in [*others, AUTO])
        lines.append(f"Try {alternatives}.")
    return "\n".join(lines)


def _other_reasons(tried: list[Assessment]) -> str:
    earlier = [f"{a.backend.name}: {'; '.join(a.reasons)}" for a in tried[:-1]]
    return (" Other backends were skipped: " + " | ".join(earlier)) if earlier else ""


@dataclass
class Opened:
    engine: Engine
    choice: Choice
    model: ModelInfo


def model_for(model: str, backend_name: str) -> ModelInfo:
    """Resolve the model argument; for a remote (proxy) backend it is just a name."""
    backend = installed_backends().get(backend_name)
    if backend is not None and not backend.loads_local_model:
        return ModelInfo.remote(model)
    return resolve_model(model)


def resolve_common(
    flags: Mapping[str, Any], profile_name: str | None = None
) -> tuple[Profile | None, dict[str, Setting]]:
    """The profile in effect and the backend-independent settings (model, backend, ...)."""
    profile = selected_profile(profile_name)
    return profile, resolve(flags, profile=profile)


def open_engine(
    model: str | None,
    flags: Mapping[str, Any],
    *,
    profile: str | None = None,
    hardware: Hardware | None = None,
) -> Opened:
    """Resolve options, choose a backend, log why, and build its engine.

    ``model`` (if given) wins over the ``model`` option from env or profile.
    """
    flags = dict(flags)
    if model is not None:
        flags["model"] = model
    profile_obj, common = resolve_common(flags, profile)
    info = model_for(common["model"].value, common["backend"].value)
    hardware = hardware or Hardware.probe()
    choice = choose(info, flags, profile=profile_obj, hardware=hardware, env=os.environ)
    for note in choice.notes:
        log.info(note)
    log.info("backend %s chosen for %s", choice.backend.name, info.name)
    engine = choice.backend.create_engine(info, choice.values, hardware)
    return Opened(engine, choice, info)
