"""llmctl: serve and chat with large language models through swappable inference backends.

``from llmctl import LLM, SamplingParams`` is the Python API. Names are imported
lazily so that ``llmctl --help`` and plugin discovery never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

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
