"""`auto` and option values: it never falls to the transformers backend for a value a
native backend refuses, a backend's own profile section is binding, turbo -> torch for a
value is a WARNING, and the preferred backend's rule leads every refusal."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest

from llmctl.errors import BackendError
from llmctl.hardware import Hardware, find_cxx_compiler
from llmctl.model.info import resolve_model
from llmctl.profiles import get_profile
from llmctl.selection import accepted_near, choose, installed_backends, select
from tests.helpers.cli import run_llmctl

CPU = Hardware(cxx_compiler=find_cxx_compiler(), cpu_count=2, memory_bytes=2**34)
AMPERE = replace(CPU, cuda_available=True, compute_capability=(8, 0))
TURING = replace(CPU, cuda_available=True, compute_capability=(7, 5))
NATIVE = ("turbo", "torch")


@pytest.fixture(scope="module")
def backends():
    installed = installed_backends()
    if "transformers" not in installed or find_cxx_compiler() is None:
        pytest.skip("needs turbo (a C++ compiler), torch and the transformers plugin")
    return {name: installed[name] for name in (*NATIVE, "transformers")}


def refused_block_sizes(backends, hardware, count: int) -> list[int]:
    """Random block sizes every native backend refuses on ``hardware`` but transformers takes."""
    rng = random.Random()
    found: list[int] = []
    while len(found) < count:
        value = rng.randint(1, 600)
        options = {"cache_block_seq_len": value, "device": "auto"}
        if all(backends[n].option_errors(options, hardware) for n in NATIVE) and not backends[
            "transformers"
        ].option_errors(options, hardware):
            found.append(value)
    return found


def accepts(backend, value, hardware) -> bool:
    return "cache_block_seq_len" not in backend.option_errors(
        {"cache_block_seq_len": value, "device": "auto"}, hardware
    )


@pytest.mark.parametrize("hardware", [CPU, AMPERE, TURING], ids=["cpu", "sm80", "sm75"])
def test_a_value_the_native_backends_refuse_is_an_error_not_transformers(backends, hardware):
    for value in refused_block_sizes(backends, hardware, 4):
        with pytest.raises(BackendError) as exc:
            choose(
                resolve_model("demo"),
                {"cache_block_seq_len": value},
                hardware=hardware,
                backends=backends,
                env={},
            )
        message = str(exc.value)
        assert f"cache_block_seq_len={value} (set by flag" in message
        assert "--backend transformers" in message
        for name in NATIVE:  # each native backend's rule, with the nearest values it takes
            line = next(line for line in message.splitlines() if line.startswith(f"  {name}: "))
            near = [
                int(v) for v in line.rsplit("nearest it accepts: ", 1)[1].rstrip(")").split(", ")
            ]
            assert all(accepts(backends[name], v, hardware) for v in near), line
            below = [v for v in near if v < value]
            above = [v for v in near if v > value]
            assert below or above
            closer = range(max(below, default=0) + 1, min(above, default=value + 1))
            assert not any(accepts(backends[name], v, hardware) for v in closer if v != value)


def test_the_transformers_backend_asked_for_by_name_takes_the_value(backends):
    value = refused_block_sizes(backends, CPU, 1)[0]
    flags = {"cache_block_seq_len": value, "backend": "transformers"}
    choice = choose(resolve_model("demo"), flags, hardware=CPU, backends=backends, env={})
    assert choice.backend.name == "transformers"


def test_turbo_to_torch_for_a_value_is_a_warning_naming_the_rule(backends, caplog, monkeypatch):
    monkeypatch.setattr(Hardware, "probe", classmethod(lambda cls: CPU))
    with caplog.at_level(logging.INFO, logger="llmctl"):
        choice = select("demo", {"tensor_parallel_size": 2}, env={})
    assert choice.backend.name == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "turbo passed over for tensor_parallel_size=2 (set by flag" in w
        and "tensor_parallel_size must be 1" in w
        and "torch serves instead" in w
        for w in warnings
    ), warnings


@pytest.mark.parametrize(
    ("section", "common", "refuser"),
    [
        ("turbo", "", "turbo"),
        ("torch", "tensor_parallel_size = 2\n", "torch"),  # turbo refuses tp 2: torch's turn
    ],
)
def test_a_backends_own_section_is_binding(
    backends, tmp_path, monkeypatch, section, common, refuser
):
    value = refused_block_sizes(backends, CPU, 1)[0]
    (tmp_path / "llmctl.toml").write_text(
        f"[profiles.p]\n{common}[profiles.p.{section}]\ncache_block_seq_len = {value}\n"
    )
    monkeypatch.chdir(tmp_path)
    profile = get_profile("p")
    with pytest.raises(BackendError) as exc:
        choose(resolve_model("demo"), {}, profile=profile, hardware=CPU, backends=backends, env={})
    message = str(exc.value)
    assert f"cache_block_seq_len={value} in " in message and f"[profiles.p.{section}]" in message
    assert f"refused by {refuser}:" in message and "binding" in message


@pytest.mark.parametrize(
    ("flags", "hardware", "lead"),
    [
        ({"kv_cache_dtype": "fp8"}, CPU, "turbo"),
        ({"kv_cache_dtype": "fp8"}, AMPERE, "turbo"),
        ({"device": "cuda"}, CPU, "turbo"),
        ({"kv_cache_dtype": "fp8"}, TURING, "turbo"),
    ],
)
def test_the_preferred_backends_reason_leads(backends, flags, hardware, lead):
    with pytest.raises(BackendError) as exc:
        choose(resolve_model("demo"), flags, hardware=hardware, backends=backends, env={})
    first, *rest = str(exc.value).splitlines()
    name = next(iter(flags))
    assert first.startswith(f"{name}={flags[name]!r} (set by flag") and f"by {lead}: " in first
    refused = backends["torch"].option_errors({"device": "auto", **flags}, hardware)
    if name in refused:  # torch's own words follow at once
        assert rest[0].startswith(f"  and by torch: {refused[name]}")


def test_accepted_near_for_choices_and_flags(backends):
    values = {"kv_cache_dtype": "fp8", "device": "auto", "dtype": "auto"}
    assert accepted_near(backends["torch"], "kv_cache_dtype", values, CPU) == ["auto", "int8"]
    assert accepted_near(backends["torch"], "device", {**values, "device": "cuda"}, CPU) == [
        "auto",
        "cpu",
    ]


def test_explain_shows_why_each_backend_was_passed_over():
    result = run_llmctl("config", "show", "--explain", "--tp", "2", "--model", "demo")
    assert result.returncode == 0, result.stderr
    assert "turbo passed over: tensor_parallel_size=2 refused" in result.stdout
    assert "auto chooses torch" in result.stdout
