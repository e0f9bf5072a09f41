"""Bench tests run ``llmctl bench`` in this process, one torch thread at a time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The test machine is shared: one thread keeps runs fast and their timing stable."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
