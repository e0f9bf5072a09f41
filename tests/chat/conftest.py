"""Shared by the chat tests: stories260K, one live server on it, one in-process LLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmctl import LLM
from tests.conftest import STORIES
from tests.helpers.server_process import running_server

API_KEY = "chat-test-key"

# A small real chat template, so that stories260K (which has none) can chat too.
QA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% else %}A: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)


@pytest.fixture(scope="session")
def stories() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K fixture not found at {STORIES} (it lives in ../shared/)")
    return STORIES


@pytest.fixture(scope="session")
def stories_server(stories: Path) -> Iterator[str]:
    """``llmctl serve`` on stories260K with an API key; yields its base URL."""
    args = [str(stories), "--backend", "torch", "--api-keys", API_KEY]
    with running_server(args, env={"OMP_NUM_THREADS": "1"}) as url:
        yield url


@pytest.fixture(scope="session")
def qa_llm(stories: Path) -> Iterator[LLM]:
    """The Python API on stories260K with QA_TEMPLATE (plain prompts ignore the template)."""
    with LLM(str(stories), backend="torch", chat_template=QA_TEMPLATE) as llm:
        yield llm
