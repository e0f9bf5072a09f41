"""Turn a model argument (``demo``, a local directory, a cached hub id) into facts backends check.

Resolving reads only ``config.json``. A directory the user named is checked further on
first use of ``problems``, once per command: ``llmctl.model.check`` reads the
config values, the safetensors headers and the tokenizer files (no torch, no weights).
Loading happens in the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.errors import ModelError
from llmctl.model.files import read_architecture, read_json_object

if TYPE_CHECKING:
    from llmctl.model.check import ModelReport

DEMO_NAME = "demo"


@dataclass(frozen=True)
class ModelInfo:
    """What is known about a model before it loads."""

    name: str
    path: Path
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    is_demo: bool = False
    # A directory the user named (or a hub cache snapshot): checked before it is loaded.
    # Not the demo (llmctl writes it) nor a remote model (no directory here).
    is_user_dir: bool = False
    # The chat_template option, which replaces the directory's own template when set.
    chat_template: str | None = None

    @classmethod
    def remote(cls, name: str) -> ModelInfo:
        """A model served elsewhere (by a proxy backend): only its name is known."""
        return cls(name=name, path=Path(), config={"architectures": ["remote"]})

    @property
    def architecture(self) -> str:
        try:
            return read_architecture(self.config, "config.json")
        except ModelError:  # the check reports it (problems)
            return "unknown"

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    @cached_property
    def report(self) -> ModelReport:
        """What llmctl reads from the directory and what is wrong with it (checked once).

        Imported here, not at the top: the check reads weights and tokenizer files, which
        resolving a model name must not pay for."""
        from llmctl.model.check import check_model_dir

        return check_model_dir(self.path, self.chat_template)

    @property
    def problems(self) -> list[str]:
        """Why llmctl's engines cannot load this directory (empty: nothing found)."""
        return list(self.report.problems) if self.is_user_dir else []

    def ensure_loadable(self) -> None:
        """Raise a ModelError listing the problems, if there are any."""
        if self.problems:
            raise ModelError(self.report.error_message())


def resolve_model(arg: str) -> ModelInfo:
    """Find the model named by ``arg`` without loading it.

    ``demo`` is the built-in random model; otherwise a directory holding config.json,
    or a Hugging Face hub id already in the local cache (nothing is downloaded).
    """
    if arg == DEMO_NAME:
        from llmctl.model.demo import DEMO_CONFIG, demo_model_dir

        return ModelInfo(name=DEMO_NAME, path=demo_model_dir(), config=DEMO_CONFIG, is_demo=True)
    path = Path(arg).expanduser()
    if path.is_dir():
        return ModelInfo(name=arg, path=path, config=_read_config(path), is_user_dir=True)
    if path.exists():
        raise ModelError(
            f"model {arg!r} is a file; give the directory that holds config.json, the "
            "safetensors weights and the tokenizer files"
        )
    if arg.count("/") == 1 and not arg.startswith((".", "/", "~")):
        snapshot = _hf_cache_snapshot(arg)
        if snapshot is not None:
            return ModelInfo(
                name=arg, path=snapshot, config=_read_config(snapshot), is_user_dir=True
            )
        raise ModelError(
            f"model {arg!r} is not in the local Hugging Face cache ({hf_hub_cache()}). "
            "llmctl never downloads: fetch it first (e.g. `hf download "
            f"{arg}`), or pass a local directory, or use the built-in `demo` model"
        )
    raise ModelError(
        f"model {arg!r} not found: expected `demo`, a local directory with config.json, "
        "or a Hugging Face hub id (org/name) already in the local cache"
    )


def _read_config(path: Path) -> dict[str, Any]:
    return read_json_object(path / "config.json", required=True)


def hf_hub_cache() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return Path(home) / "hub"


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory ``refs/main`` points at (else the newest one), if any."""
    repo_dir = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return candidates[0] if candidates else None
