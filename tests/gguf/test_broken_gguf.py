"""Broken GGUF files, as a user meets them: each kind of damage in ``broken_gguf`` gives
one ``Error:`` paragraph naming the file and what is wrong, no traceback and a non-zero
exit, on ``serve`` with each local backend (torch, turbo, transformers) and on
``backends check`` (which lists it as each backend's reason). Nothing starts serving.

Every case runs in-process through what those commands call; the real CLI runs as
subprocesses on a sample, and on every case with the slow ones.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from llmctl.errors import ModelError
from llmctl.hardware import Hardware
from llmctl.model.info import resolve_model
from llmctl.selection import assess, installed_backends, select
from tests.gguf.broken_gguf import CASES
from tests.helpers.cli import run_llmctl

BACKENDS = ("torch", "turbo", "transformers")
COMMANDS = {
    **{f"serve-{b}": ("serve", "--backend", b, "--port", "0") for b in BACKENDS},
    "backends-check": ("backends", "check"),
}
CLI_SAMPLE = {"truncated", "unreadable-tensor-type", "shapes-disagree"}
NO_COMPILER = Hardware(cxx_compiler=None, cpu_count=2, memory_bytes=2**34)


@pytest.fixture
def broken(tiny_checkpoint, tmp_path):
    def make(case: str):
        make_file, _ = CASES[case]
        return make_file(tiny_checkpoint("llama-mqa"), tmp_path)

    return make


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("case", list(CASES))
def test_every_backend_refuses_before_building_an_engine(broken, case):
    path = broken(case)
    _, fragments = CASES[case]
    for backend in BACKENDS:
        with pytest.raises(ModelError) as refused:
            select(str(path), {"backend": backend}, hardware=NO_COMPILER, env={})
        message = flat(str(refused.value))
        assert str(path) in message, (backend, message)
        for fragment in fragments:
            assert fragment in message, (backend, message)


@pytest.mark.parametrize("case", list(CASES))
def test_each_backends_check_gives_the_problem_as_a_reason(broken, case):
    model = resolve_model(str(broken(case)))
    _, fragments = CASES[case]
    for name in BACKENDS:
        if name not in installed_backends():
            continue
        backend = installed_backends()[name]
        reasons = flat(" ".join(assess(backend, model, {}, None, NO_COMPILER, env={}).reasons))
        for fragment in fragments:
            assert fragment in reasons, (name, reasons)


@pytest.mark.parametrize(
    "case",
    [case if case in CLI_SAMPLE else pytest.param(case, marks=pytest.mark.slow) for case in CASES],
)
def test_the_cli_says_one_clear_error_and_serves_nothing(broken, case):
    _, fragments = CASES[case]
    path = broken(case)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda args: run_llmctl(*args, str(path), timeout=180), COMMANDS.values())
        results = dict(zip(COMMANDS, runs))
    for command, result in results.items():
        output = result.stdout + result.stderr
        where = f"{case}, {command}:\n{output}"
        assert result.returncode == 1, where
        assert "Traceback" not in output, where
        assert output.count("Error:") == 1, where
        error = flat(result.stderr[result.stderr.index("Error:") :])
        for fragment in fragments:
            assert fragment in error, where
        assert "Serving on" not in output and "KV cache" not in output, where
    reasons = flat(results["backends-check"].stdout)
    for fragment in fragments:
        assert reasons.count(fragment) >= 2, results["backends-check"].stdout
