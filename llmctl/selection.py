"""``--backend auto``: rank installed backends, check each, fall back, and say why.

Rules (docs/architecture.md): backends are tried by priority; each one skipped gets a
log line with its reasons. A value the user set explicitly is never changed: if the
backend that would serve refuses it, that is an error naming the option, value,
backend and rule. Defaults are resolved per backend, so a fallback gets its own defaults.

Option values and ``auto``:
- ``auto`` never falls to a ``last_resort`` backend (transformers) because of a value a
  native backend refuses when that backend could otherwise serve the model: an error
  names the option, the value, each native backend's rule and the nearest values each
  accepts (``--backend transformers`` takes the slower engine on purpose);
- a value in a backend's own profile section that it refuses is an error, never a
  reason to skip it;
- moving on between native backends (turbo to torch) for a value is allowed, with a
  WARNING naming the rule.

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
    Source,
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
    hardware: Hardware | None = None

    @property
    def values(self) -> dict[str, Any]:
        return {name: s.value for name, s in self.settings.items()}

    @property
    def only_values_refused(self) -> bool:
        """Skipped only for values the user set: with other values it would serve."""
        rules = self.refused_explicit.values()
        return bool(rules) and all(any(rule in r for rule in rules) for r in self.reasons)

    def refusal(self, name: str) -> str:
        """One line: the rule this backend breaks for option ``name``, and the values
        nearest to the user's that it accepts."""
        near = accepted_near(self.backend, name, self.values, self.hardware)
        nearest = f" (nearest it accepts: {', '.join(map(repr, near))})" if near else ""
        return f"{self.backend.name}: {self.refused_explicit[name]}{nearest}"


@dataclass
class Choice:
    """The backend that serves ``model`` here, with the settings resolved for it."""

    backend: Backend
    model: ModelInfo
    hardware: Hardware
    settings: dict[str, Setting]
    skipped: list[Assessment]
    notes: list[str]
    warnings: list[str] = field(default_factory=list)  # logged as WARNING: a value moved auto

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
    threads, cores = choice.values.get("cpu_threads"), choice.hardware.cpu_count
    if threads and cores and threads > cores:  # they would take turns on the cores
        choice.warnings.append(
            f"cpu_threads={threads} is more than the {cores} CPU core(s) here: threads beyond "
            "one per core wait for each other and slow every step"
        )
    for warning in choice.warnings:
        log.warning(warning)
    for note in choice.notes:
        log.info(note)
    # Said only when llmctl chose: a named backend is the user's own choice, and a tool
    # that opens several engines on it (``bench quality``) would repeat the line for each.
    if choice.values.get("backend") == AUTO:
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
    return Assessment(backend, settings, reasons, explicit, hardware)


# How far from the user's integer ``accepted_near`` looks for accepted ones.
_NEAR_SEARCH = 4096


def accepted_near(
    backend: Backend, name: str, values: Mapping[str, Any], hardware: Hardware | None
) -> list[Any]:
    """The values of option ``name`` nearest to ``values[name]`` that ``backend``'s rules
    accept with the other values as they are: for an integer the closest below and
    above, for a choice every accepted choice, for a flag the other value."""
    rules = [rule for rule in backend.rules if rule.option == name]
    if hardware is None or not rules:
        return []
    opt = option_named(name)
    value = values[name]

    def accepts(candidate: Any) -> bool:
        trial = {**values, name: candidate}
        try:
            return not any(rule.refuses(candidate, trial, hardware) for rule in rules)
        except Exception:  # a rule that cannot judge this value: not a suggestion
            return False

    if opt.choices is not None:
        return [c for c in opt.choices if c != value and accepts(c)]
    if opt.kind == "bool":
        return [not value] if accepts(not value) else []
    if opt.kind != "int" or not isinstance(value, int):
        return []
    low = int(opt.min) if opt.min is not None else value - _NEAR_SEARCH
    high = int(opt.max) if opt.max is not None else value + _NEAR_SEARCH
    below = next(
        (v for v in range(value - 1, max(low, value - _NEAR_SEARCH) - 1, -1) if accepts(v)), None
    )
    above = next(
        (v for v in range(value + 1, min(high, value + _NEAR_SEARCH) + 1) if accepts(v)), None
    )
    return [v for v in (below, above) if v is not None]


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
            if verdict.backend.last_resort:
                _refuse_last_resort_for_values(model, verdict, skipped)
            notes = [
                f"{s.backend.name} skipped: {'; '.join(s.reasons)}"
                for s in skipped
                if not s.only_values_refused
            ]
            notes += _fallback_notes(skipped, verdict)
            warnings = [
                f"{s.backend.name} passed over for {name}={s.settings[name].value!r} "
                f"(set by {describe_source(s.settings[name])}): {rule}; "
                f"{verdict.backend.name} serves instead"
                for s in skipped
                if s.only_values_refused
                for name, rule in s.refused_explicit.items()
            ]
            return Choice(
                verdict.backend, model, hardware, verdict.settings, skipped, notes, warnings
            )
        _refuse_own_section(verdict)
        skipped.append(verdict)
    raise BackendError(_no_backend_message(model, requested, skipped, backends))


def _refuse_own_section(verdict: Assessment) -> None:
    """A value in a backend's own profile section that the backend refuses is an error:
    the user wrote it for this backend, so skipping the backend over it would be wrong."""
    if not verdict.only_values_refused:
        return  # skipped for other reasons too: its section is not what decides
    for name in verdict.refused_explicit:
        setting = verdict.settings[name]
        if setting.source == Source.PROFILE_BACKEND:
            raise BackendError(
                f"{name}={setting.value!r} in {setting.detail} is refused by "
                f"{verdict.refusal(name)}. A backend's own profile section is binding, "
                f"never a reason to skip it: fix the value or remove it."
            )


def _refuse_last_resort_for_values(
    model: ModelInfo, chosen: Assessment, skipped: list[Assessment]
) -> None:
    """``auto`` reached a last-resort backend: an error if a native backend was skipped
    only for values the user set (it could serve the model with other values)."""
    blocked = [s for s in skipped if not s.backend.last_resort and s.only_values_refused]
    if not blocked:
        return
    names = list(dict.fromkeys(name for s in blocked for name in s.refused_explicit))
    given = ", ".join(
        f"{name}={blocked[0].settings[name].value!r} "
        f"(set by {describe_source(blocked[0].settings[name])})"
        for name in names
        if name in blocked[0].settings
    )
    lines = [
        f"the native backends could serve {model.name} but refuse {given}; `auto` does "
        f"not move to {chosen.backend.name} (a slower engine, for models the native "
        "backends cannot run) because of an option value:"
    ]
    lines += [
        f"  {s.refusal(name)}" for name in names for s in blocked if name in s.refused_explicit
    ]
    lines.append(
        f"Choose a value one of them accepts, or pass --backend {chosen.backend.name} to "
        "use the slower engine on purpose."
    )
    raise BackendError("\n".join(lines))


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
    # The preferred backend (the first in priority) leads: its rule is the one that
    # matters (torch's "fp8 needs compute capability >= 8.9", not transformers' refusal).
    # Backends that could serve the model with other values come first: a backend that
    # lacks the architecture anyway has nothing to say about the value.
    refusing = [a for a in tried if a.refused_explicit]
    refusing.sort(key=lambda a: not a.only_values_refused)  # stable: priority order kept
    if refusing:
        first = refusing[0]
        name = next(iter(first.refused_explicit))
        setting = first.settings[name]
        # The others that refuse only this kind of value say their rule right after;
        # the rest (no such architecture, say) are listed with every reason.
        also = [
            a
            for a in refusing[1:]
            if name in a.refused_explicit
            and (a.only_values_refused or not first.only_values_refused)
        ]
        lines = [
            f"{name}={setting.value!r} (set by {describe_source(setting)}) is refused by "
            f"{first.refusal(name)}",
            *(f"  and by {a.refusal(name)}" for a in also),
            "llmctl never changes a value you set: choose a value a backend accepts, or "
            "remove the setting.",
        ]
        return "\n".join(lines) + _other_reasons([a for a in tried if a not in [first, *also]])
    defaulted = bool(tried) and tried[0].settings["model"].source == Source.DEFAULT
    what = f"the default model {model.name} (no model was given)" if defaulted else model.name
    lines = [f"no backend can serve {what} here:"]
    lines += [f"  {a.backend.name}: {'; '.join(a.reasons)}" for a in tried]
    if requested != AUTO:
        others = [name for name in backends if name != requested]
        alternatives = " or ".join(f"--backend {n}" for n in [*others, AUTO])
        lines.append(f"Try {alternatives}.")
    return "\n".join(lines)


def _other_reasons(others: list[Assessment]) -> str:
    reasons = [f"  {a.backend.name}: {'; '.join(a.reasons)}" for a in others]
    return "\nOther backends' reasons:\n" + "\n".join(reasons) if reasons else ""


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
