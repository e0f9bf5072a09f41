"""The skeleton in docs/plugins.md is real code: it registers through the hookspecs and its
engine honours the Engine protocol (streaming, limits, refusals, abort)."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
from pathlib import Path

import pluggy
import pytest

from llmctl.backend import Engine, GenerationOutput, GenerationRequest, SamplingParams
from llmctl.errors import InvalidRequest
from llmctl.hardware import Hardware
from llmctl.model.info import ModelInfo
from llmctl.plugins import hookspecs

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def code_block(language: str, starts_with: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    return next(block for block in blocks if block.startswith(starts_with))


@pytest.fixture(scope="module")
def shout(tmp_path_factory: pytest.TempPathFactory):
    """The guide's llmctl_shout/plugin.py, imported from a file as a plugin module."""
    path = tmp_path_factory.mktemp("guide") / "plugin.py"
    path.write_text(code_block("python", "# llmctl_shout/plugin.py"))
    spec = importlib.util.spec_from_file_location("guide_shout_plugin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pyproject_declares_the_entry_point() -> None:
    pyproject = tomllib.loads(code_block("toml", "[build-system]"))
    assert pyproject["project"]["entry-points"]["llmctl"] == {"shout": "llmctl_shout.plugin"}


def test_hooks_register_the_backend_and_its_option(shout) -> None:
    manager = pluggy.PluginManager("llmctl")
    manager.add_hookspecs(hookspecs)
    manager.register(shout)
    backends, options = [], []
    manager.hook.llmctl_register_backends(register=backends.append)
    manager.hook.llmctl_register_options(register=options.append)
    assert [b.name for b in backends] == ["shout"]
    assert [(o.name, o.flag, o.env_var) for o in options] == [
        ("shout_delay", "--shout-delay", "LLMCTL_SHOUT_DELAY")
    ]
    backend, hardware = backends[0](), Hardware()
    assert backend.check(ModelInfo.remote("x"), {"shout_delay": 0.0}, hardware) == []
    reasons = backend.check(ModelInfo.remote("x"), {"shout_delay": 5.0}, hardware)
    assert reasons == ["shout_delay=5.0 refused: at most 1 second, or nobody waits for the answer"]


async def collect(engine: Engine, request: GenerationRequest) -> list[GenerationOutput]:
    return [output async for output in engine.generate(request)]


def test_the_engine_streams_stops_refuses_and_aborts(shout) -> None:
    backend = shout.ShoutBackend()
    options = {"model_name": None, "shout_delay": 0.0}
    engine = backend.create_engine(ModelInfo.remote("loud"), options, Hardware())
    assert isinstance(engine, Engine) and engine.model_name == "loud"

    def run(prompt: str, max_tokens: int) -> list[GenerationOutput]:
        request = GenerationRequest("r", prompt=prompt, sampling=SamplingParams(max_tokens))
        return asyncio.run(collect(engine, request))

    whole = run("hi there you", 16)
    assert "".join(o.text for o in whole) == "HI THERE YOU"
    assert (whole[-1].finish_reason, whole[-1].completion_tokens) == ("stop", 3)
    cut = run("hi there you", 2)
    assert ("".join(o.text for o in cut), cut[-1].finish_reason) == ("HI THERE", "length")
    with pytest.raises(InvalidRequest, match="empty"):
        run("   ", 4)

    slow = backend.create_engine(ModelInfo.remote("x"), {**options, "shout_delay": 0.01}, None)

    async def abort_after_one() -> list[GenerationOutput]:
        outputs = []
        request = GenerationRequest("a", prompt="one two three four", sampling=SamplingParams())
        async for output in slow.generate(request):
            outputs.append(output)
            await slow.abort("a")
        return outputs

    aborted = asyncio.run(abort_after_one())
    assert [o.finish_reason for o in aborted] == [None, "abort"]
    assert slow.stats().running == 0
