"""Shared test setup: paths to fixtures and a clean llmctl environment per test."""

from __future__ import annotations

import datetime
import os
import random
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"

# A default run keeps this many of a parametrized test's slow cases, drawn afresh each
# day, so the suite stays quick and every case still runs over a few days of CI.
SLOW_SAMPLE = 8


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("llmctl")
    group.addoption(
        "--all-slow",
        action="store_true",
        help="run every slow case of a parametrized test, not a sample of "
        f"{SLOW_SAMPLE} (the whole corpus of broken files, every GGUF type and kind)",
    )
    group.addoption(
        "--slow-seed",
        type=int,
        default=None,
        help="the seed that draws the slow sample (default: today's date, YYYYMMDD; "
        "the run names it at its end, so a failure can be drawn again)",
    )


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """Name the sample's seed at the end, where even ``-q`` shows it."""
    if not config.getoption("--all-slow"):
        terminalreporter.write_line(
            f"slow cases: {SLOW_SAMPLE} per parametrized test, drawn with "
            f"--slow-seed={config.getoption('--slow-seed')} (--all-slow runs every one)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Sample the slow cases of each parametrized test (see ``SLOW_SAMPLE``).

    A test named alone, or with fewer slow cases than the sample, runs whole. The draw
    depends only on the seed and the test's name, not on what else was collected.
    """
    if config.getoption("--all-slow"):
        return
    seed = config.getoption("--slow-seed")
    slow_cases: dict[str, list[pytest.Item]] = {}
    for item in items:
        if hasattr(item, "callspec") and item.get_closest_marker("slow"):
            slow_cases.setdefault(item.nodeid.split("[")[0], []).append(item)
    dropped = set()
    for test, cases in slow_cases.items():
        if len(cases) > SLOW_SAMPLE:
            kept = random.Random(f"{seed}:{test}").sample(cases, SLOW_SAMPLE)
            dropped.update(case for case in cases if case not in kept)
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item in dropped])
        items[:] = [item for item in items if item not in dropped]


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal gives it, however the suite was started. A script's
    `command &` starts it with SIGINT ignored, and an ignored signal stays ignored
    through exec: every server the tests start would then ignore it too, and a Ctrl-C
    test's server, stopped by uvicorn's own handler, would exit 0, not 130."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The slow sample's default seed, fixed once, so a run over midnight draws one
    # sample. (pytest-xdist's workers parse the command line again, each reading the
    # date itself: a sampled run with workers should name --slow-seed.)
    if config.getoption("--slow-seed") is None:
        config.option.slow_seed = int(datetime.date.today().strftime("%Y%m%d"))


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
