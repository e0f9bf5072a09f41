"""What every Triton kernel of the torch backend needs first: the interpreter switch, and
the tile-size helpers (``dot_tile``, ``tuning_configs``).

Import ``triton`` and ``tl`` from here, never directly: on a machine without CUDA,
Triton can only run kernels through its interpreter, and it decides between compiling
and interpreting when ``@triton.jit`` runs (at import, for our kernels and for
triton.language's own helpers), by reading ``TRITON_INTERPRET``. Setting the variable
here, before triton is first imported, is what lets the same kernels run (slowly, in
numpy) on a CPU-only machine. ``TRITON_INTERPRET=0`` keeps the kernels compiled even
without a GPU: they can then be compiled ahead of time for a GPU target, not run.
"""

from __future__ import annotations

import os
import sys

import torch

_ASKED = os.environ.get("TRITON_INTERPRET")  # "1" or "0" decides; unset: by the hardware
INTERPRET = _ASKED == "1" or (_ASKED != "0" and not torch.cuda.is_available())
if INTERPRET and _ASKED != "1":
    if "triton" in sys.modules:
        # triton.language's own helpers (tl.zeros, tl.max, ...) were then made for the
        # compiler, and an interpreted kernel calling them fails.
        raise RuntimeError(
            "the Triton attention kernels can only run through Triton's interpreter here "
            "(no CUDA GPU), but triton was imported before it could be switched on (torch "
            "imports triton lazily, e.g. for torch.compile). Set TRITON_INTERPRET=1 before "
            "starting Python, import llmctl_torch.triton_attention first, or use "
            "LLMCTL_TORCH_ATTENTION=torch."
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (must come after the interpreter switch above)
import triton.language as tl  # noqa: E402

__all__ = ["INTERPRET", "UPCAST_LOADS", "dot_tile", "tl", "triton", "tuning_configs"]

# The interpreter stores bfloat16 through numpy without bfloat16 arithmetic and gets it
# wrong, so interpreted kernels convert every load to fp32 and convert back at store.
UPCAST_LOADS = INTERPRET


def dot_tile(n: int) -> int:
    """A power of two >= n and >= 16: `tl.dot` needs every dimension of at least 16."""
    return max(16, triton.next_power_of_2(n))


def tuning_configs(
    gpu: list[tuple[dict[str, int], int, int]], interpreted: dict[str, int]
) -> list[triton.Config]:
    """Autotune candidates ``(kwargs, num_warps, num_stages)`` on a GPU; one config when
    interpreting, since the interpreter's timings mean nothing and benchmarking is slow."""
    if INTERPRET:
        return [triton.Config(interpreted, num_warps=1, num_stages=1)]
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in gpu]
