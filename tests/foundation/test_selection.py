"""`--backend auto`: the fallback matrix with injected hardware facts."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from llmctl.errors import BackendError
from llmctl.hardware import Hardware, find_cxx_compiler
from llmctl.model.info import ModelInfo, resolve_model
from llmctl.profiles import Source
from llmctl.selection import choose, installed_backends

CPU_WITH_COMPILER = Hardware(cxx_compiler=find_cxx_compiler(), cpu_count=2, memory_bytes=2**34)
CPU_NO_COMPILER = replace(CPU_WITH_COMPILER, cxx_compiler=None)
AMPERE = replace(CPU_WITH_COMPILER, cuda_available=True, compute_capability=(8, 0))
TURING = replace(CPU_WITH_COMPILER, cuda_available=True, compute_capability=(7, 5))


def llama() -> ModelInfo:
    return resolve_model("demo")


def model_with(architecture: str) -> ModelInfo:
    return ModelInfo("m", llama().path, {"architectures": [architecture]})


@pytest.fixture
def builtins():
    backends = installed_backends()
    assert {"turbo", "torch"} <= set(backends)
    return {name: backends[name] for name in ("turbo", "torch")}


def test_turbo_serves_when_it_can(builtins):
    if find_cxx_compiler() is None:
        pytest.skip("no C++ compiler: turbo cannot build here")
    choice = choose(llama(), {}, hardware=CPU_WITH_COMPILER, backends=builtins, env={})
    assert choice.backend.name == "turbo"
    assert choice.skipped == []


def test_no_compiler_falls_back_to_torch_with_a_reason(builtins):
    choice = choose(llama(), {}, hardware=CPU_NO_COMPILER, backends=builtins, env={})
    assert choice.backend.name == "torch"
    assert any("turbo skipped" in n and "no C++ compiler" in n for n in choice.notes)


def test_unsupported_architecture_is_refused_by_name(builtins):
    with pytest.raises(BackendError) as exc:
        choose(model_with("BertModel"), {}, hardware=CPU_NO_COMPILER, backends=builtins, env={})
    assert "architecture BertModel is not supported" in str(exc.value)


def test_architecture_only_torch_supports_falls_back_to_torch(builtins):
    torch_only = (
        builtins["torch"].supported_architectures - builtins["turbo"].supported_architectures
    )
    if not torch_only:
        pytest.skip("torch supports no architecture that turbo lacks")
    model = model_with(sorted(torch_only)[0])
    choice = choose(model, {}, hardware=CPU_NO_COMPILER, backends=builtins, env={})
    assert choice.backend.name == "torch"


def test_turbo_takes_adapters_on_cuda_and_on_the_cpu(builtins, tmp_path):
    """turbo serves LoRA adapters on both devices (csrc/cpu/lora_kernels.h,
    csrc/cuda/lora.cu): its check finds nothing against them on either."""
    from tests.helpers.lora_adapters import write_small_adapter

    adapters = {"a": str(write_small_adapter(tmp_path / "a", llama().path))}
    turbo = builtins["turbo"]
    cuda = replace(CPU_WITH_COMPILER, cuda_available=True, compute_capability=(9, 0))
    options = {"model": str(llama().path), "lora": adapters, "cache_block_seq_len": 64}
    assert not any("LoRA" in r for r in turbo.check(llama(), {**options, "device": "cuda"}, cuda))
    assert not any("LoRA" in r for r in turbo.check(llama(), options, CPU_WITH_COMPILER))
    # An adapter it cannot serve is still refused, with the reason, on CUDA too.
    small_rank = {**options, "device": "cuda", "max_lora_rank": 1}
    assert any("max_lora_rank" in r for r in turbo.check(llama(), small_rank, cuda))


def test_explicit_block_size_refused_by_the_fallback_is_an_error(builtins):
    with pytest.raises(BackendError) as exc:
        choose(
            llama(),
            {"cache_block_seq_len": 48},
            hardware=CPU_NO_COMPILER,
            backends=builtins,
            env={},
        )
    message = str(exc.value)
    for fragment in ("torch", "cache_block_seq_len=48", "flag", "power of two"):
        assert fragment in message


def test_explicit_turbo_that_cannot_serve_suggests_alternatives(builtins):
    with pytest.raises(BackendError) as exc:
        choose(llama(), {"backend": "turbo"}, hardware=CPU_NO_COMPILER, backends=builtins, env={})
    assert "no C++ compiler" in str(exc.value)
    assert "--backend torch or --backend auto" in str(exc.value)


def test_unknown_backend_suggests_the_closest(builtins):
    with pytest.raises(BackendError, match="Did you mean 'torch'"):
        choose(llama(), {"backend": "torhc"}, hardware=CPU_NO_COMPILER, backends=builtins, env={})


@pytest.mark.parametrize(
    ("hardware", "block", "ok"),
    [
        (CPU_NO_COMPILER, 48, True),
        (CPU_NO_COMPILER, 40, False),
        (AMPERE, 96, True),
        (AMPERE, 48, False),
        (TURING, 96, False),
        (TURING, 128, True),
    ],
)
def test_turbo_block_size_rules(builtins, hardware, block, ok):
    errors = builtins["turbo"].option_errors({"cache_block_seq_len": block}, hardware)
    assert ("cache_block_seq_len" not in errors) == ok


@pytest.mark.parametrize(("block", "ok"), [(16, True), (256, True), (8, False), (48, False)])
def test_torch_block_size_rule(builtins, block, ok):
    errors = builtins["torch"].option_errors({"cache_block_seq_len": block}, CPU_NO_COMPILER)
    assert ("cache_block_seq_len" not in errors) == ok


def test_defaults_come_from_each_backend(builtins, monkeypatch):
    """A defaulted value is each backend's own default, and the fallback says so."""
    monkeypatch.setattr(type(builtins["turbo"]), "option_defaults", {"cache_block_seq_len": 48})
    monkeypatch.setattr(type(builtins["torch"]), "option_defaults", {"cache_block_seq_len": 32})
    choice = choose(llama(), {}, hardware=CPU_NO_COMPILER, backends=builtins, env={})
    setting = choice.settings["cache_block_seq_len"]
    assert (choice.backend.name, setting.value, setting.source) == (
        "torch",
        32,
        Source.BACKEND_DEFAULT,
    )
    assert any("torch uses 32" in n and "turbo's 48" in n for n in choice.notes)


def test_select_logs_why_backends_were_skipped(caplog, monkeypatch):
    """The log lines come from selection, before any engine is built."""
    from llmctl.selection import select

    monkeypatch.setattr(logging.getLogger("llmctl"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="llmctl"):
        choice = select("demo", {}, hardware=CPU_NO_COMPILER, env={})
    assert choice.backend.name == "torch"
    assert "turbo skipped" in caplog.text


@pytest.mark.parametrize(
    ("hardware", "device", "value", "ignored"),
    [
        (CPU_NO_COMPILER, "auto", True, True),
        (AMPERE, "cpu", True, True),
        (AMPERE, "auto", True, False),
        (CPU_NO_COMPILER, "auto", False, False),  # off is off everywhere: nothing to say
    ],
)
def test_cuda_graphs_are_ignored_on_the_cpu_and_said_so(builtins, hardware, device, value, ignored):
    for backend in builtins.values():
        options = {"cuda_graphs": value, "device": device}
        assert "cuda_graphs" not in backend.option_errors(options, hardware)  # never refused
        note = backend.option_notes(options, hardware).get("cuda_graphs")
        assert (note is not None) == ignored
        assert note is None or "ignored on the CPU" in note


@pytest.mark.parametrize("value", [True, False])
def test_cuda_graphs_reach_each_backends_engine_config(builtins, value):
    choice = choose(
        llama(), {"cuda_graphs": value}, hardware=CPU_NO_COMPILER, backends=builtins, env={}
    )
    options = choice.values | {"cuda_graphs": value}
    for name in ("torch", "turbo"):
        assert builtins[name].translate(options).cuda_graphs is value
