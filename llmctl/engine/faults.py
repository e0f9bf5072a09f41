"""Faults injected into the model call, for tests of fault containment only.

``LLMCTL_TEST_FAULT=model_call:N`` makes the engine's N-th model call raise (a fault
that fails one step); ``model_call:2,5`` the 2nd and the 5th; ``model_call:N+`` the
N-th and every later one (a model that broke for good). The variable is read once, when
an engine starts; unset, the check costs one comparison per step. The fault is raised
where the runner would run, so what follows (the step's requests failing, the engine
stopping) is the real path.
"""

from __future__ import annotations

import os
import re

ENV_VAR = "LLMCTL_TEST_FAULT"
_SPEC = re.compile(r"model_call:(\d+\+?(?:,\d+\+?)*)")


class InjectedFault(RuntimeError):
    """The failure ``LLMCTL_TEST_FAULT`` asked for."""


class FaultPlan:
    """Which model calls fail: those in ``calls``, and every one from ``from_call`` on."""

    def __init__(self, calls: frozenset[int] = frozenset(), from_call: int | None = None):
        self.calls = calls
        self.from_call = from_call
        self.active = bool(calls) or from_call is not None
        self.count = 0

    @classmethod
    def from_env(cls) -> FaultPlan:
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return cls()
        match = _SPEC.fullmatch(spec)
        if match is None:
            raise ValueError(f"{ENV_VAR}={spec!r}: expected model_call:N[,M...] or model_call:N+")
        items = match.group(1).split(",")
        onwards = [int(item[:-1]) for item in items if item.endswith("+")]
        calls = frozenset(int(item) for item in items if not item.endswith("+"))
        return cls(calls, min(onwards) if onwards else None)

    def before_model_call(self) -> None:
        if not self.active:
            return
        self.count += 1
        if self.count in self.calls or (
            self.from_call is not None and self.count >= self.from_call
        ):
            raise InjectedFault(f"fault injected by {ENV_VAR} into model call {self.count}")
