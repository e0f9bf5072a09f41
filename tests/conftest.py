"""Shared test setup: paths to fixtures and a clean llmctl environment per test."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal gives it, however the suite was started. A script's
    `command &` starts it with SIGINT ignored, and an ignored signal stays ignored
    through exec: every server the tests start would then ignore it too, and a Ctrl-C
    test's server, stopped by uvicorn's own handler, would exit 0, not 130."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def stories_dir() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    return STORIES


@pytest.fixture(autouse=True)
def _no_user_llmctl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no LLMCTL_* variables from the developer's shell (the cache dir stays)."""
    for name in list(os.environ):
        if name.startswith("LLMCTL_") and name not in ("LLMCTL_CACHE_DIR",):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: the test machine is shared, tiny models gain nothing."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(kind)`` → a directory with that tiny model (``tests.helpers.tiny_models``),
    made once per session."""
    from tests.helpers.tiny_models import make_tiny_model

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_tiny_model(tmp_path_factory.mktemp(kind), kind)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def emulated():
    """turbo's CUDA kernels built for the CPU emulator (tests/backends/turbo/cuda_emulator),
    called through their C ABI on CPU tensors; skipped where the CUDA headers are absent."""
    from tests.backends.turbo.cuda_emulator import library

    try:
        return library.load()
    except library.EmulatorUnavailable as why:
        pytest.skip(str(why))
