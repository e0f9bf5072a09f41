"""Building turbo's native ops: the cache key, the build log, remembered failures."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from llmctl_turbo import build

from llmctl.errors import BackendError
from llmctl.hardware import Hardware

CPU = Hardware(cxx_compiler=build.find_cxx_compiler(), cpu_count=2)


def test_key_covers_sources_flags_and_torch():
    spec = build.build_spec(CPU)
    assert build.build_spec(CPU).key == spec.key
    for change in (
        dict(sources_sha256="0" * 64),
        dict(cxx_flags=(*spec.cxx_flags, "-DEXTRA")),
        dict(torch_version="0.0"),
        dict(cuda_version="12.4"),
    ):
        assert replace(spec, **change).key != spec.key
    assert spec.directory.parent.name == "turbo"
    assert not spec.with_cuda  # this torch is CPU-only, or no GPU is present


def test_built_ops_report_no_problem(turbo_ops):
    assert build.build_problem(CPU) is None
    assert "already built" in build.prepare(CPU)


def test_failed_build_is_reported_with_its_log_and_remembered(tmp_path, monkeypatch):
    if CPU.cxx_compiler is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "CXX_FLAGS", (*build.CXX_FLAGS, "-fno-such-flag-for-turbo"))
    spec = build.build_spec(CPU)

    problem = build.build_problem(CPU)
    assert problem is not None and str(spec.log) in problem
    assert "llmctl backends build turbo" in problem
    assert "-fno-such-flag-for-turbo" in spec.log.read_text()

    # The failure is remembered: the next check answers at once, without compiling.
    log_written = spec.log.stat().st_mtime_ns
    started = time.monotonic()
    assert build.build_problem(CPU) == problem
    assert time.monotonic() - started < 1
    assert spec.log.stat().st_mtime_ns == log_written

    # An explicit build tries again (and fails again, with the same kind of reason).
    with pytest.raises(BackendError, match="build log"):
        build.prepare(CPU)
    assert spec.log.stat().st_mtime_ns != log_written
