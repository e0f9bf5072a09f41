"""Moving a step's small tensors between host and device without waiting for the device.

A plain ``torch.tensor(values, device="cuda")`` or ``tensor.tolist()`` synchronises
with the GPU's queue: the host would stop until the model call in flight ends, which
is exactly the time the engine uses to prepare the next step. Host-to-device copies
therefore go through pinned memory with ``non_blocking``; device-to-host copies land in
pinned memory and an event says when they are complete. On the CPU both are plain
tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for queued GPU work."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class HostCopy:
    """A device tensor on its way to the host; ``get()`` waits for it and returns it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tensor, None

    def get(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host
