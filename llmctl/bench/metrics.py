"""Small measuring tools shared by the benchmarks: percentiles, memory peaks, KV sizes."""

from __future__ import annotations

import math
import os
import resource
import sys
import threading
from typing import Any


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

    RSS is sampled by a background thread (torch releases the GIL in its kernels, so
    the thread keeps sampling during a long synchronous ``generate``); on CUDA torch's
    own peak counter is exact. RSS includes whatever the process held before the block.
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
        else:
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
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())


def uses_cuda(device_option: str) -> bool:
    """Whether an engine given the ``device`` option runs on CUDA (``auto``: if available)."""
    if device_option == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_dtype(config: dict[str, Any], dtype_option: str, cuda: bool) -> str:
    """The dtype an engine runs in: ``auto`` is float32 on CPU, the model's dtype on GPU."""
    if dtype_option != "auto":
        return dtype_option
    if not cuda:
        return "float32"
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return dtype if dtype in _DTYPE_BYTES else "float32"


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """Bytes of K and V one token takes across all layers, from the model config."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[dtype]
