"""Fixtures of the torch backend tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.backends.torch.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(kind)`` → a directory with that tiny model, made once per session."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_tiny_model(tmp_path_factory.mktemp(kind), kind)
        return made[kind]

    return get
