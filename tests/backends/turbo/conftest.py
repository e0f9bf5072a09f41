"""Fixtures of the turbo backend tests: the native ops (built once, cached across runs).
The tiny transformers models come from the root conftest's ``tiny_model_dir``."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def turbo_ops():
    """``torch.ops.llmctl_turbo``, built on first use into llmctl's cache dir."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build turbo's native ops (install g++)")
    from llmctl_turbo.build import load_ops

    return load_ops()


ISAS = ["avx512vnni", "avx512", "avx2", "portable"]


@pytest.fixture(params=ISAS)
def isa(request, turbo_ops):
    """Each instruction set this CPU supports, selected for the test, then the best."""
    best = turbo_ops.cpu_isa()
    try:
        turbo_ops.set_cpu_isa(request.param)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    yield request.param
    turbo_ops.set_cpu_isa(best)
