from __future__ import annotations

import pytest

from tests.conftest import STORIES


@pytest.fixture(scope="session")
def stories_tokenizer():
    from llmctl.model.tokenizer import Tokenizer

    if not (STORIES / "tokenizer.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    return Tokenizer.from_dir(STORIES)
