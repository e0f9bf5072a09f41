"""The torch backend's thread policy on the CPU (``llmctl_torch.cpu_threads``): a small
step on one thread, its large products and plain-torch attention on the caller's count."""

from __future__ import annotations

import threading

import pytest
import torch
from llmctl_torch import cpu_threads
from llmctl_torch.cpu_threads import (
    THREADED_PRODUCT_MACS,
    THREADED_WEIGHT_BYTES,
    one_thread_step,
    product,
    threaded,
)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_step_runs_on_one_thread_and_its_large_products_on_all(two_threads):
    counts = []

    def count() -> int:
        counts.append(torch.get_num_threads())
        return counts[-1]

    small_weight = THREADED_WEIGHT_BYTES - 1
    assert product(0, 0, count) == 2  # outside a step: as set
    with one_thread_step(2):
        assert torch.get_num_threads() == 1
        assert product(THREADED_PRODUCT_MACS - 1, small_weight, count) == 1
        assert product(THREADED_PRODUCT_MACS, small_weight, count) == 2  # by its work
        assert torch.get_num_threads() == 1  # back after the product
        assert product(1, THREADED_WEIGHT_BYTES, count) == 2  # by its weight
        assert torch.get_num_threads() == 1
        assert threaded(count)() == 2  # whatever its size
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    assert product(0, 0, count) == 2
    assert threaded(count)() == 2


def test_a_failing_product_or_step_leaves_the_counts_as_they_were(two_threads):
    def fail() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError), one_thread_step(2):
        with pytest.raises(RuntimeError):
            product(THREADED_PRODUCT_MACS, 0, fail)
        assert torch.get_num_threads() == 1
        fail()
    assert torch.get_num_threads() == 2
    assert getattr(cpu_threads._step, "threads", 0) == 0


def test_the_step_is_the_calling_threads_own(two_threads):
    """Another thread (the engine's beside a caller's) is not in this thread's step."""
    seen = []
    with one_thread_step(2):
        worker = threading.Thread(
            target=lambda: seen.append(getattr(cpu_threads._step, "threads", 0))
        )
        worker.start()
        worker.join()
    assert seen == [0]
