"""Third-party plugins installed with pip: discovered, listed, selectable; broken ones skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.cli import run_llmctl

FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """pip-install the echo and broken plugins into a private directory (not the venv)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--target", str(target),
            str(FIXTURES / "llmctl-echo-plugin"), str(FIXTURES / "llmctl-broken-plugin"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    return target


def _env(site: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}


def test_installed_plugin_is_listed_with_its_hooks(plugin_site):
    result = run_llmctl("plugins", env=_env(plugin_site))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "echo" in out and "llmctl-echo-plugin" in out and "0.3.0" in out
    for hook in ("llmctl_register_backends", "llmctl_register_commands", "llmctl_register_options"):
        assert hook in out
    assert "broken" in out and "this plugin is broken on purpose" in out and "skipped" in out


def test_plugin_backend_is_listed_and_selectable(plugin_site):
    listing = run_llmctl("backends", env=_env(plugin_site))
    assert listing.returncode == 0, listing.stderr
    assert "echo" in listing.stdout and "llmctl-echo-plugin" in listing.stdout
    check = run_llmctl("backends", "check", "demo", "--backend", "echo", env=_env(plugin_site))
    assert "auto would pick echo" in check.stdout or "would pick echo" in check.stdout, check.stdout


def test_plugin_option_and_command_work(plugin_site):
    shown = run_llmctl(
        "config", "show", "--backend", "echo", "--echo-upper", "--explain", env=_env(plugin_site)
    )
    assert shown.returncode == 0, shown.stderr
    assert any("echo_upper" in line and "true" in line for line in shown.stdout.splitlines())
    hello = run_llmctl("echo-hello", "--name", "llmctl", env=_env(plugin_site))
    assert hello.stdout.strip() == "hello, llmctl"


def test_plugin_engine_generates_through_the_engine_surface(plugin_site):
    code = (
        "import asyncio\n"
        "from llmctl.selection import select\n"
        "from llmctl.backend import GenerationRequest\n"
        "from llmctl.engine.sampling_params import SamplingParams\n"
        "choice = select('demo', {'backend': 'echo', 'echo_upper': True})\n"
        "engine = choice.create_engine()\n"
        "async def main():\n"
        "    req = GenerationRequest('r1', prompt='hello plugin world', "
        "sampling=SamplingParams(max_tokens=8))\n"
        "    return ''.join([o.text async for o in engine.generate(req)])\n"
        "print(choice.backend.name, asyncio.run(main()))\n"
    )
    env = {**os.environ, **_env(plugin_site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "echo HELLO PLUGIN WORLD", out.stderr


def test_llmctl_plugins_restricts_loading(plugin_site):
    result = run_llmctl("plugins", env=_env(plugin_site, LLMCTL_PLUGINS="torch,turbo"))
    assert "echo" not in result.stdout.split("LLMCTL_PLUGINS")[0]
    assert "broken" not in result.stdout
    assert "LLMCTL_PLUGINS restricts loading to: torch, turbo" in result.stdout
