"""Small measuring tools shared by the benchmarks: percentiles, memory peaks, KV sizes."""

from __future__ import annotations

import math
import os
import resource
import sys
import threading


def summarize(values: list[float]) -> dict[str, float] | None:
    """Mean and p50/p90/p99 (linear interpolation, as numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return {
        "mean": sum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
    }


def percentile(ordered: list[float], q: float) -> float:
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes


class MemoryPeak:
    """Peak memory over a ``with`` block: process RSS on CPU, allocated memory on CUDA.

    On Linux the kernel's own high-water mark is reset at the start (``clear_refs``) and
    read at the end (``VmHWM``), so even a short-lived allocation counts. Elsewhere RSS
    is sampled by a background thread. On CUDA torch's peak counter is exact.
    """

    def __init__(self, cuda: bool, interval_s: float = 0.02) -> None:
        self.cuda = cuda
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def measure(self) -> str:
        return "cuda_max_memory_allocated" if self.cuda else "process_rss"

    def __enter__(self) -> MemoryPeak:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif not _reset_rss_high_water_mark():
            self.peak_bytes = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            import torch

            self.peak_bytes = torch.cuda.max_memory_allocated()
        elif self._thread is None:
            self.peak_bytes = _rss_high_water_mark()
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())


def _reset_rss_high_water_mark() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _rss_high_water_mark() > 0
    except OSError:
        return False


def _rss_high_water_mark() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
