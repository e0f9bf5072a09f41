"""The plugin as a user meets it: ``pip install`` adds a backend, its options and flags;
without it, they are gone.

"Gone" is shown two ways. Fast: ``LLMCTL_PLUGINS`` keeps llmctl from loading the plugin
in the shared environment, which must never lose a package other tests rely on. Slow and
literal: a throwaway virtualenv that sees the shared packages except this plugin, where
the plugin is really built and pip-installed, then pip-uninstalled.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers.cli import run_llmctl
from tests.plugins.conftest import DISTRIBUTION, PLUGIN_DIR, require_plugin_installed

# `llmctl backends` runs every backend's hardware check, and turbo's builds its native
# code when it is not built yet (minutes): the listings below leave turbo out, as it is
# not what they test. `llmctl plugins` runs no check and lists everything.
WITH_PROXY = {"LLMCTL_PLUGINS": "torch,openai-proxy"}
WITHOUT_PROXY = {"LLMCTL_PLUGINS": "torch"}


def test_installed_plugin_is_listed() -> None:
    require_plugin_installed()
    plugins = run_llmctl("plugins")
    assert plugins.returncode == 0, plugins.stderr
    row = next(line for line in plugins.stdout.splitlines() if "openai-proxy" in line)
    assert DISTRIBUTION in row and "llmctl_openai_proxy.plugin" in row
    assert "llmctl_register_backends" in row and "llmctl_register_options" in row

    backends = run_llmctl("backends", env=WITH_PROXY)
    assert backends.returncode == 0, backends.stderr
    row = next(line for line in backends.stdout.splitlines() if "openai-proxy" in line)
    assert DISTRIBUTION in row and "yes" in row  # it runs anywhere: nothing to build


def test_plugin_not_loaded_is_not_listed() -> None:
    for command in ("plugins", "backends"):
        result = run_llmctl(
            command,
            env={"LLMCTL_PLUGINS": "torch,turbo"} if command == "plugins" else WITHOUT_PROXY,
        )
        assert result.returncode == 0, result.stderr
        assert "openai-proxy" not in result.stdout
        assert "torch" in result.stdout
    help_text = run_llmctl("serve", "--help-all", env=WITHOUT_PROXY).stdout
    assert "--cache-block-seq-len" in help_text
    assert "--proxy-url" not in help_text


def test_options_come_from_flags_env_and_profiles(tmp_path: Path) -> None:
    require_plugin_installed()
    assert "--proxy-url" in run_llmctl("serve", "--help-all").stdout
    assert "--proxy-connect-timeout" in run_llmctl("chat", "--help-all").stdout
    (tmp_path / "llmctl.toml").write_text(
        '[profiles.remote]\nbackend = "openai-proxy"\nproxy_url = "http://profile.example:8000"\n'
        "\n[profiles.remote.openai-proxy]\nproxy_timeout = 42.0\n"
    )
    show = run_llmctl(
        "config",
        "show",
        "--profile",
        "remote",
        "--explain",
        "--proxy-connect-timeout",
        "2.5",
        env={"LLMCTL_PROXY_API_KEY": "from-env"},
        cwd=tmp_path,
    )
    assert show.returncode == 0, show.stderr
    rows = {line.split("│")[1].strip(): line for line in show.stdout.splitlines() if "│" in line}
    assert (
        "http://profile.example:8000" in rows["proxy_url"] and "llmctl.toml:3" in rows["proxy_url"]
    )
    assert "42.0" in rows["proxy_timeout"] and "profile section" in rows["proxy_timeout"]
    assert (
        "2.5" in rows["proxy_connect_timeout"]
        and "--proxy-connect-timeout" in rows["proxy_connect_timeout"]
    )
    assert "LLMCTL_PROXY_API_KEY" in rows["proxy_api_key"]


def test_a_bad_option_value_is_refused_with_the_rule() -> None:
    require_plugin_installed()
    result = run_llmctl(
        "backends",
        "check",
        "some-model",
        "--backend",
        "openai-proxy",
        "--proxy-url",
        "localhost:8000",
        env={"LLMCTL_PLUGINS": "openai-proxy"},
    )
    assert result.returncode == 1
    assert (
        "proxy_url='localhost:8000' refused: expected an http:// or https:// URL" in result.stdout
    )


@pytest.mark.slow
def test_pip_install_and_uninstall_in_a_throwaway_venv(tmp_path: Path) -> None:
    """A real ``pip install`` of a built wheel, then ``pip uninstall``, with the listing in
    between, in a venv that borrows every shared package except this plugin."""
    shared = Path(sysconfig.get_paths()["purelib"])
    borrowed = tmp_path / "borrowed-site-packages"
    borrowed.mkdir()
    for entry in shared.iterdir():  # the plugin's files, editable or not, stay out
        if "llmctl_openai_proxy" not in entry.name.replace("-", "_"):
            (borrowed / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    own_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # An `import` line in a .pth file runs at startup: addsitedir also runs the borrowed
    # .pth files, which is how the editable llmctl packages are found.
    Path(own_site, "borrowed.pth").write_text(f"import site; site.addsitedir({str(borrowed)!r})\n")
    source = tmp_path / "llmctl-openai-proxy"  # build a copy: no build/ in the repo
    shutil.copytree(PLUGIN_DIR, source, ignore=shutil.ignore_patterns("*.egg-info", "build"))

    def listed() -> bool:
        result = run_llmctl("plugins", python=python)
        assert result.returncode == 0, result.stderr
        return "openai-proxy" in result.stdout

    def pip(*args: str) -> None:
        result = subprocess.run(
            [python, "-m", "pip", *args, "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr

    assert not listed()
    pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(source))
    assert listed()
    backends = run_llmctl("backends", python=python, env=WITH_PROXY).stdout
    assert any("openai-proxy" in line and DISTRIBUTION in line for line in backends.splitlines())
    pip("uninstall", "-y", DISTRIBUTION)
    assert not listed()
    assert "--proxy-url" not in run_llmctl("serve", "--help-all", python=python).stdout
