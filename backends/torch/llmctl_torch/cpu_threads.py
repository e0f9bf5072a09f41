"""How many torch threads each part of a CPU step runs on.

torch's OpenMP threads sleep between parallel regions (``OMP_WAIT_POLICY=PASSIVE``, set
in ``llmctl/__init__.py`` so that a busy neighbour does not starve the step), and in a VM
waking them costs tens of microseconds a region. A step is mostly short elementwise
regions (norms, rotary, silu, residual adds), each too small to pay for that: on two
threads an RMSNorm of 64 rows of 512 took 137 µs, on one 21. Its matrix products are
different: they stream the weights, and two cores stream more than one.

So on the CPU the runner runs a step whose activations (tokens x hidden size) are fewer
than ``ONE_THREAD_STEP_ELEMENTS`` on one thread (``one_thread_step``), and only its
large products take the runner's thread count (``product``). Measured on 2 cores: an
RMSNorm and a silu-and-multiply pay for a second thread from about 512 rows of 512 (a
prompt's rows). A product pays for it in two ways. By its work: from about 4M
multiply-adds (``THREADED_PRODUCT_MACS``; [16, 512] x [512, 1536], 13M, ran 1.22x
faster on two threads, [64, 512] x [512, 2816] 1.63x, one of 3M at the same speed). Or
by its weight, which a step reads from memory rather than from the core's cache: from
1 MiB (``THREADED_WEIGHT_BYTES``), because two cores stream about four times what one
does here (36 against 9 GB/s). Eight rows through a [512, 512] weight took as long
on one thread as on two, one row through [2048, 512] 0.85x as long on two, and a 24M
model's decode step of one sequence 15 ms against 17 (docs/benchmarks.md). Products
that are not linear layers (plain-torch attention) take every thread whatever their
size (``threaded``). Larger steps, and everything outside a step, keep the thread count
as it is. Linear layers on turbo's kernel (``linear.NativeMethod``, where turbo's ops
build) run on turbo's own thread pool instead, at its full count.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

ONE_THREAD_STEP_ELEMENTS = 1 << 18
THREADED_PRODUCT_MACS = 4_000_000
THREADED_WEIGHT_BYTES = 1 << 20

Result = TypeVar("Result")

# The thread count products may take while this thread runs a step (0: not in a step).
_step = threading.local()


@contextmanager
def one_thread_step(threads: int) -> Iterator[None]:
    """Run the body (one CPU step) on one torch thread; its large products take
    ``threads``. The count is set back to ``threads`` after."""
    if threads <= 1:
        yield
        return
    _step.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _step.threads = 0
        torch.set_num_threads(threads)


def product(macs: int, weight_bytes: int, fn: Callable[..., Result], *args: Any) -> Result:
    """``fn(*args)``, a product of ``macs`` multiply-adds over a weight of
    ``weight_bytes``: on the step's thread count where it is large by either, else on
    the step's one thread."""
    threads = getattr(_step, "threads", 0)
    if threads <= 1 or (macs < THREADED_PRODUCT_MACS and weight_bytes < THREADED_WEIGHT_BYTES):
        return fn(*args)
    return _on_threads(threads, fn, *args)


def threaded(fn: Callable[..., Result]) -> Callable[..., Result]:
    """``fn`` on the step's thread count whatever its size (a kernel made of products)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Result:
        threads = getattr(_step, "threads", 0)
        if threads <= 1:
            return fn(*args, **kwargs)
        return _on_threads(threads, lambda: fn(*args, **kwargs))

    return run


def _on_threads(threads: int, fn: Callable[..., Result], *args: Any) -> Result:
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(1)
