"""The suite's sample of slow cases (``tests/conftest.py``): a default run keeps
``SLOW_SAMPLE`` of a parametrized test's slow cases, drawn by a seed the run names at its
end; ``--all-slow`` keeps them all, and a case named alone always runs."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, SLOW_SAMPLE

TEST = "tests/models/test_broken_models.py::test_the_cli_says_one_clear_error_and_serves_nothing"


def pytest_output(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *args],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout


def collected(*args: str) -> list[str]:
    """The node ids ``pytest --collect-only ARGS`` keeps."""
    return [line for line in pytest_output("-q", *args).splitlines() if "::" in line]


def test_a_default_run_draws_the_slow_cases_by_its_seed():
    every = collected(TEST, "--all-slow")
    slow = collected(TEST, "--all-slow", "-m", "slow")
    assert len(slow) > 2 * SLOW_SAMPLE
    first = collected(TEST, "--slow-seed", "1")
    again = collected(TEST, "--slow-seed", "1")
    other = collected(TEST, "--slow-seed", "2")
    assert first == again  # the same seed draws the same cases
    assert first != other
    for sample in (first, other):
        assert len(sample) == len(every) - len(slow) + SLOW_SAMPLE
        assert set(sample) <= set(every)
        assert set(every) - set(slow) <= set(sample)  # the fast cases always run


def test_the_run_names_its_seed_and_a_named_case_runs_alone():
    assert "drawn with --slow-seed=7" in pytest_output(TEST, "--slow-seed", "7")
    every = collected(TEST, "--all-slow", "-m", "slow")
    alone = collected(every[-1], "--slow-seed", "7")
    assert alone == every[-1:]
