"""quantization and kv_cache_dtype through the option schema: flags, env, profiles, each
backend's rules (with injected hardware), the fallback and the CLI's messages."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.errors import BackendError, OptionError
from llmctl.hardware import Hardware
from llmctl.model.info import resolve_model
from llmctl.options import option_named
from llmctl.profiles import Source, get_profile, resolve
from llmctl.selection import choose, installed_backends
from tests.helpers.cli import run_llmctl

CPU = Hardware(cxx_compiler="/usr/bin/c++", cpu_count=2, memory_bytes=2**34)
AMPERE = replace(CPU, cuda_available=True, compute_capability=(8, 0))
ADA = replace(CPU, cuda_available=True, compute_capability=(8, 9))
HOPPER = replace(CPU, cuda_available=True, compute_capability=(9, 0))


@pytest.fixture
def builtins():
    backends = installed_backends()
    return {name: backends[name] for name in ("turbo", "torch")}


@pytest.fixture
def turbo_builds_here(builtins, monkeypatch):
    """turbo can serve as far as its build goes: only option rules may refuse it."""
    monkeypatch.setattr(type(builtins["turbo"]), "check_hardware", lambda self, hardware: [])


def test_the_options_are_in_the_schema_with_their_choices():
    assert option_named("quantization").choices == ("none", "int8", "int4", "gguf")
    assert option_named("quantization").default == "none"
    assert option_named("kv_cache_dtype").choices == ("auto", "int8", "fp8")
    assert option_named("kv_cache_dtype").default == "auto"
    with pytest.raises(OptionError, match="not one of auto, int8, fp8"):
        option_named("kv_cache_dtype").convert("int4", "flag --kv-cache-dtype")


def test_env_and_profile_set_them(tmp_path):
    path = tmp_path / "llmctl.toml"
    path.write_text(
        '[profiles.q]\nquantization = "int8"\n[profiles.q.torch]\nkv_cache_dtype = "fp8"\n'
    )
    profile = get_profile("q", [path])
    settings = resolve({}, profile=profile, backend="torch", env={"LLMCTL_KV_CACHE_DTYPE": "int8"})
    assert (settings["quantization"].value, settings["quantization"].source) == (
        "int8",
        Source.PROFILE,
    )
    assert (settings["kv_cache_dtype"].value, settings["kv_cache_dtype"].source) == (
        "int8",
        Source.ENV,
    )


@pytest.mark.parametrize(
    ("hardware", "device", "refused"),
    [
        (CPU, "auto", True),
        (CPU, "cpu", True),
        (AMPERE, "auto", True),
        (ADA, "auto", False),
        (HOPPER, "cuda", False),
        (HOPPER, "cpu", True),
    ],
)
def test_torch_fp8_needs_cuda_compute_capability_8_9(builtins, hardware, device, refused):
    errors = builtins["torch"].option_errors({"kv_cache_dtype": "fp8", "device": device}, hardware)
    assert ("kv_cache_dtype" in errors) == refused
    if refused:
        assert "8.9" in errors["kv_cache_dtype"]


@pytest.mark.parametrize("hardware", [CPU, AMPERE, HOPPER])
def test_torch_takes_int8_weights_and_cache_everywhere(builtins, hardware):
    options = {"quantization": "int8", "kv_cache_dtype": "int8", "device": "auto"}
    assert builtins["torch"].option_errors(options, hardware) == {}


@pytest.mark.parametrize("hardware", [CPU, AMPERE, HOPPER])
def test_turbo_takes_an_int8_cache_everywhere_and_refuses_fp8(builtins, hardware):
    """turbo's CPU kernels and its CUDA SIMT attention kernel read an int8 cache; no
    kernel of turbo reads fp8, and the refusal names the torch backend."""
    turbo = builtins["turbo"]
    default = option_named("kv_cache_dtype").default
    for value in (default, "int8"):
        assert turbo.option_errors({"kv_cache_dtype": value, "device": "auto"}, hardware) == {}
    errors = turbo.option_errors({"kv_cache_dtype": "fp8", "device": "auto"}, hardware)
    assert "the torch backend supports kv_cache_dtype=fp8" in errors["kv_cache_dtype"]


@pytest.mark.parametrize("hardware", [CPU, AMPERE, HOPPER])
def test_turbo_takes_int8_weights_on_cpu_and_cuda(builtins, hardware):
    """turbo's CUDA int8 kernel (csrc/cuda/int8_linear.cu) serves every model dtype, an
    int8 cache beside it too."""
    turbo = builtins["turbo"]
    for dtype in ("auto", "bfloat16", "float16"):
        options = {"quantization": "int8", "device": "auto", "dtype": dtype}
        refused = hardware is CPU and dtype == "float16"  # turbo's CPU kernels: fp32 / bf16
        assert ("quantization" in turbo.option_errors(options, hardware)) == refused
    both = {"quantization": "int8", "kv_cache_dtype": "int8", "device": "auto"}
    assert turbo.option_errors(both, hardware) == {}


def test_gguf_runs_on_turbo_and_torch_refuses_it(builtins):
    """quantization=gguf: turbo's CPU block kernels take float32 / bfloat16, its CUDA
    kernel every dtype, and both need a GGUF file; torch has none and says so."""
    turbo, torch_backend = builtins["turbo"], builtins["torch"]
    gguf = {"quantization": "gguf", "device": "auto", "model": "/models/m.Q4_1.gguf"}
    assert turbo.option_errors(gguf, CPU) == {}
    half = {**gguf, "dtype": "float16"}
    assert "not float16" in turbo.option_errors(half, CPU)["quantization"]
    for dtype in ("auto", "bfloat16", "float16"):
        assert turbo.option_errors({**gguf, "dtype": dtype}, HOPPER) == {}
    directory = {**gguf, "model": "/models/some-hf-checkpoint"}
    assert "is not one" in turbo.option_errors(directory, CPU)["quantization"]
    # The default model's name stands for its file (SmolLM2's Q4_1 GGUF).
    assert turbo.option_errors({**gguf, "model": "smollm2-135m"}, CPU) == {}
    assert "no kernels for GGUF blocks" in torch_backend.option_errors(gguf, CPU)["quantization"]


def test_auto_keeps_turbo_for_int8_cache_and_picks_torch_for_fp8_saying_why(
    builtins, turbo_builds_here
):
    model = resolve_model("demo")
    int8 = {"kv_cache_dtype": "int8"}
    for hardware in (CPU, HOPPER):
        assert choose(model, int8, hardware=hardware, backends=builtins, env={}).backend.name == (
            "turbo"
        )
    choice = choose(model, {"kv_cache_dtype": "fp8"}, hardware=HOPPER, backends=builtins, env={})
    assert choice.backend.name == "torch"
    assert any(  # a value moved auto between native backends: a WARNING naming the rule
        "turbo passed over for kv_cache_dtype='fp8'" in warning and "no fp8" in warning
        for warning in choice.warnings
    )


def test_explicit_fp8_on_this_cpu_is_an_error_naming_option_value_backend_rule(builtins):
    with pytest.raises(BackendError) as exc:
        choose(
            resolve_model("demo"),
            {"kv_cache_dtype": "fp8", "backend": "torch"},
            hardware=CPU,
            backends=builtins,
            env={},
        )
    message = str(exc.value)
    for fragment in ("refused by torch", "kv_cache_dtype='fp8'", "flag", ">= 8.9"):
        assert fragment in message


def test_a_profile_section_for_one_backend_does_not_leak_to_another(
    builtins, turbo_builds_here, tmp_path
):
    path = tmp_path / "llmctl.toml"
    path.write_text('[profiles.q.torch]\nkv_cache_dtype = "fp8"\n[profiles.q.turbo]\nseed = 3\n')
    profile = get_profile("q", [path])
    model = resolve_model("demo")
    # turbo serves with its own (default) value; torch's fp8 is not seen there.
    choice = choose(model, {}, profile=profile, hardware=CPU, backends=builtins, env={})
    assert choice.backend.name == "turbo"
    assert choice.settings["kv_cache_dtype"].value == "auto"
    # torch itself must honour the section: on this CPU that is the named error.
    with pytest.raises(BackendError, match="kv_cache_dtype='fp8'.*profile section"):
        choose(
            model, {"backend": "torch"}, profile=profile, hardware=CPU, backends=builtins, env={}
        )
    # and on a Hopper GPU torch takes it.
    torch_choice = choose(
        model, {"backend": "torch"}, profile=profile, hardware=HOPPER, backends=builtins, env={}
    )
    assert torch_choice.settings["kv_cache_dtype"].value == "fp8"


def test_a_turbo_section_fp8_is_binding_not_a_move_to_torch(builtins, turbo_builds_here, tmp_path):
    """A value in turbo's own section that turbo refuses is an error, never a reason to
    skip turbo (and serve on torch with the schema default)."""
    path = tmp_path / "llmctl.toml"
    path.write_text('[profiles.q.turbo]\nkv_cache_dtype = "fp8"\n')
    profile = get_profile("q", [path])
    with pytest.raises(BackendError, match=r"kv_cache_dtype='fp8' in .*\[profiles.q.turbo\]"):
        choose(resolve_model("demo"), {}, profile=profile, hardware=CPU, backends=builtins, env={})


def test_backends_check_lists_the_rule_and_the_choice(tmp_path):
    result = run_llmctl("backends", "check", "demo", "--kv-cache-dtype", "int8", cwd=tmp_path)
    out = " ".join(result.stdout.split())
    assert result.returncode == 0, out + result.stderr
    assert "✓ turbo can serve" in out
    assert "auto would pick turbo" in out


def test_fp8_on_this_cpu_from_the_cli_is_one_paragraph(tmp_path):
    result = run_llmctl(
        "backends", "check", "demo", "--kv-cache-dtype", "fp8", "--device", "cpu", cwd=tmp_path
    )
    flat = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, flat
    assert "Traceback" not in flat
    for fragment in (
        "kv_cache_dtype='fp8'",
        "torch",
        "compute capability >= 8.9",
        "turbo has no fp8 KV-cache kernels",
    ):
        assert fragment in flat


def test_config_show_explains_both(tmp_path):
    result = run_llmctl(
        "config", "show", "--backend", "torch", "--explain", "--quantization", "int8",
        cwd=tmp_path, env={"LLMCTL_KV_CACHE_DTYPE": "int8"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│" in line}
    assert "flag" in rows["quantization"] and "int8" in rows["quantization"]
    assert "env (LLMCTL_KV_CACHE_DTYPE)" in rows["kv_cache_dtype"]
