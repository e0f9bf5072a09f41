"""Where llmctl keeps its files: user config (profiles) and cache (demo model, builds)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """``LLMCTL_CACHE_DIR`` if set, else the platform's user cache dir for llmctl."""
    return Path(os.environ.get("LLMCTL_CACHE_DIR") or platformdirs.user_cache_dir("llmctl"))


def config_dir() -> Path:
    """``LLMCTL_CONFIG_DIR`` if set, else the platform's user config dir for llmctl."""
    return Path(os.environ.get("LLMCTL_CONFIG_DIR") or platformdirs.user_config_dir("llmctl"))
