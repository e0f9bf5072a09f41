"""llmctl: serve and chat with large language models through swappable inference backends.

``from llmctl import LLM, SamplingParams`` is the Python API. Names are imported
lazily so that ``llmctl --help`` and plugin discovery never import torch.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# OpenMP threads that wait (at a region's end, between regions) sleep instead of
# spinning. torch's OpenMP (libgomp) spins by default, and on a machine whose cores are
# all busy a spinning thread takes the core that the thread it waits for needs: the
# torch backend's decode step ran 5-15x slower beside a 2-thread torch loop in another
# process, with sleeping waits about 2x (scripts/bench_neighbour.py). libgomp reads this
# once, when torch is first imported, so it is set here, before anything imports torch;
# a value the user set (OMP_WAIT_POLICY=ACTIVE) is kept. turbo's threads are its own.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from llmctl.api import LLM
    from llmctl.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from llmctl.api import LLM

        return LLM
    if name == "SamplingParams":
        from llmctl.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'llmctl' has no attribute {name!r}")
