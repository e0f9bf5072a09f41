"""Faults injected into the model call, for tests of fault containment only.

``LLMCTL_TEST_FAULT=model_call:N`` makes the engine's N-th model call raise (a fault
that fails one step); ``model_call:N+`` makes it and every later call raise (a model
that broke for good). The variable is read once, when an engine starts; unset, the
check costs one comparison per step. The fault is raised where the runner would run,
so whatever follows (failing the step's requests, the engine stopping) is the real path.
"""

from __future__ import annotations

import os
import re

ENV_VAR = "LLMCTL_TEST_FAULT"
_SPEC = re.compile(r"model_call:(\d+)(\+?)")


class InjectedFault(RuntimeError):
    """The failure ``LLMCTL_TEST_FAULT`` asked for."""


class FaultPlan:
    """Which model calls fail: the ``first``-th, and every later one if ``forever``."""

    def __init__(self, first: int | None = None, forever: bool = False) -> None:
        self.first = first
        self.forever = forever
        self.calls = 0

    @classmethod
    def from_env(cls) -> FaultPlan:
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return cls()
        match = _SPEC.fullmatch(spec)
        if match is None:
            raise ValueError(f"{ENV_VAR}={spec!r}: expected model_call:N or model_call:N+")
        return cls(int(match.group(1)), forever=bool(match.group(2)))

    def before_model_call(self) -> None:
        if self.first is None:
            return
        self.calls += 1
        if self.calls == self.first or (self.forever and self.calls > self.first):
            raise InjectedFault(f"fault injected by {ENV_VAR} into model call {self.calls}")
