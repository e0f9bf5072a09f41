"""``--backend auto``: rank installed backends, check each, fall back, and say why.

Rules (docs/architecture.md): backends are tried by priority; each one skipped gets a
log line with its reasons. A value the user set explicitly is never changed: if the
backend that would serve refuses it, that is an error naming the option, value,
backend and rule. Defaults are resolved per backend, so a fallback gets its own defaults.

``select`` is where every command that builds an engine starts: it reads the profile
once, resolves the options once per candidate backend and returns the ``Choice``,
whose ``create_engine`` loads the model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llmctl.backend import Backend, Engine, Hardware, ModelInfo
from llmctl.errors import BackendError
from llmctl.model.info import resolve_model
from llmctl.options import did_you_mean, option_named
from llmctl.plugins.manager import registered_backends
from llmctl.profiles import (
    Keywords,
    Profile,
    Setting,
    describe_source,
    resolve,
    selected_profile,
)

log = logging.getLogger("llmctl")

AUTO = "auto"


def installed_backends() -> dict[str, Backend]:
    """Backends registered by the loaded plugins, by name, highest priority first."""
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
    """The backend that serves ``model`` here, with the settings resolved for it."""

    backend: Backend
    model: ModelInfo
    hardware: Hardware
    settings: dict[str, Setting]
    skipped: list[Assessment]
    notes: list[str]

    @property
    def values(self) -> dict[str, Any]:
        return {name: s.value for name, s in self.settings.items()}

    def create_engine(self) -> Engine:
        """Load the model into the chosen backend's engine."""
        return self.backend.create_engine(self.model, self.values, self.hardware)


def select(
    model: str | None,
    flags: Mapping[str, Any],
    *,
    profile: str | None = None,
    hardware: Hardware | None = None,
    env: Mapping[str, str] | None = None,
) -> Choice:
    """Read the profile, resolve the options and choose the backend, logging why each
    skipped backend could not serve. ``model`` (if given) wins over the ``model`` option
    from env or profile. Nothing is loaded yet: call ``Choice.create_engine()``."""
    if model is not None:  # keywords of LLM(...) stay Keywords, to be labelled as such
        given = {**flags, "model": model}
        flags = Keywords(given) if isinstance(flags, Keywords) else given
    profile_obj = selected_profile(profile, env)
    info = model_from_options(flags, profile_obj, env)
    info.ensure_loadable()  # before probing the hardware imports torch: a broken dir fails fast
    choice = choose(
        info, flags, profile=profile_obj, hardware=hardware or Hardware.probe(), env=env
    )
    for note in choice.notes:
        log.info(note)
    log.info("backend %s chosen for %s", choice.backend.name, info.name)
    return choice


def assess(
    backend: Backend,
    model: ModelInfo,
    flags: Mapping[str, Any],
    profile: Profile | None,
    hardware: Hardware,
    env: Mapping[str, str] | None = None,
) -> Assessment:
    """Resolve the options for ``backend`` (its defaults, its profile section) and check them."""
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


def candidates(
    flags: Mapping[str, Any],
    *,
    profile: Profile | None = None,
    backends: Mapping[str, Backend] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, list[Backend]]:
    """The backend asked for (a name or ``auto``) and the backends to try, in order."""
    backends = installed_backends() if backends is None else backends
    requested = resolve(flags, profile=profile, env=env, options=[option_named("backend")])
    name = requested["backend"].value
    if not backends:
        raise BackendError(
            "no backend is installed: install one, e.g. `pip install llmctl-torch`, "
            "then check with `llmctl backends`"
        )
    if name != AUTO and name not in backends:
        raise BackendError(
            f"unknown backend {name!r}.{did_you_mean(name, backends)} Installed: "
            f"{', '.join(backends)} (or `auto`). See `llmctl backends`."
        )
    return name, list(backends.values()) if name == AUTO else [backends[name]]


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
    requested, tried = candidates(flags, profile=profile, backends=backends, env=env)
    verdicts = (assess(b, model, flags, profile, hardware, env) for b in tried)
    return first_that_serves(verdicts, model, hardware, requested, backends or installed_backends())


def first_that_serves(
    verdicts: Iterable[Assessment],
    model: ModelInfo,
    hardware: Hardware,
    requested: str,
    backends: Mapping[str, Backend],
) -> Choice:
    """The first backend (in priority order) with no reason against it. ``verdicts`` may be
    a generator, so backends after the chosen one are never checked."""
    model.ensure_loadable()  # a broken model directory is no backend's fault: say so once
    skipped: list[Assessment] = []
    for verdict in verdicts:
        if not verdict.reasons:
            notes = [f"{s.backend.name} skipped: {'; '.join(s.reasons)}" for s in skipped]
            notes += _fallback_notes(skipped, verdict)
            return Choice(verdict.backend, model, hardware, verdict.settings, skipped, notes)
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
    # A value the user set that a backend refused is the news, even when backends tried
    # after it (a proxy without an upstream, say) failed for other reasons.
    refusing = [a for a in tried if a.refused_explicit]
    if refusing:
        last = refusing[-1]
        name, rule = next(iter(last.refused_explicit.items()))
        setting = last.settings[name]
        return (
            f"backend {last.backend.name} cannot use {name}={setting.value!r} "
            f"(set by {describe_source(setting)}): {rule}. llmctl never changes a value you "
            f"set: choose a value {last.backend.name} accepts, or remove the setting."
            + _other_reasons([a for a in tried if a is not last])
        )
    lines = [f"no backend can serve {model.name} here:"]
    lines += [f"  {a.backend.name}: {'; '.join(a.reasons)}" for a in tried]
    if requested != AUTO:
        others = [name for name in backends if name != requested]
        alternatives = " or ".join(f"--backend {n}" for n in [*others, AUTO])
        lines.append(f"Try {alternatives}.")
    return "\n".join(lines)


def _other_reasons(others: list[Assessment]) -> str:
    reasons = [f"{a.backend.name}: {'; '.join(a.reasons)}" for a in others]
    return (" Other backends were skipped: " + " | ".join(reasons)) if reasons else ""


def model_from_options(
    flags: Mapping[str, Any], profile: Profile | None, env: Mapping[str, str] | None = None
) -> ModelInfo:
    """The model the options name: ``model``, for the backend asked for (a remote one
    takes it as a name), with the ``chat_template`` that will replace its own."""
    names = [option_named(name) for name in ("model", "backend", "chat_template")]
    common = resolve(flags, profile=profile, env=env, options=names)
    backend = installed_backends().get(common["backend"].value)
    if backend is not None and not backend.loads_local_model:
        return ModelInfo.remote(common["model"].value)
    info = resolve_model(common["model"].value)
    return replace(info, chat_template=common["chat_template"].value)
