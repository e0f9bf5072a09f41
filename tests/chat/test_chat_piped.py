"""Piped ``llmctl chat``: one answer on stdout, greedy by default, for scripts."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl import LLM, SamplingParams
from tests.chat.conftest import API_KEY
from tests.chat.run_chat import chat_piped, one_line
from tests.helpers.server_process import running_server

PROMPTS = ["Lily and Ben", "The little dog"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def greedy_answers(qa_llm: LLM) -> dict[str, str]:
    """What the Python API answers greedily to each prompt."""
    outputs = qa_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {prompt: out.text for prompt, out in zip(PROMPTS, outputs)}


def test_piped_in_process_equals_python_api(
    stories: Path, greedy_answers: dict[str, str], tmp_path: Path
) -> None:
    prompt = PROMPTS[0]
    args = [str(stories), "--backend", "torch", "--max-tokens", str(MAX_TOKENS)]
    result = chat_piped(args, prompt + "\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_answers[prompt] + "\n"
    # What changes the answer's meaning is said once, on stderr.
    assert one_line(result.stderr).count("no chat template: plain continuation mode") == 1


def test_piped_with_url_equals_python_api(
    stories_server: str, greedy_answers: dict[str, str], tmp_path: Path
) -> None:
    for prompt in PROMPTS:
        args = ["--url", stories_server, "--api-key", API_KEY, "--max-tokens", str(MAX_TOKENS)]
        result = chat_piped(args, prompt, tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout == greedy_answers[prompt] + "\n"


def test_wrong_api_key_is_named(stories_server: str, tmp_path: Path) -> None:
    result = chat_piped(["--url", stories_server, "--api-key", "wrong"], "hi", tmp_path)
    assert result.returncode == 1
    assert "refused the API key (HTTP 401)" in one_line(result.stderr)


@pytest.mark.slow  # starts a server of its own
def test_server_refusing_chat_messages_falls_back_to_completions(
    stories: Path, greedy_answers: dict[str, str], tmp_path: Path
) -> None:
    """A server whose model has no chat template answers chat requests with a 400 saying
    so (here: a template that refuses, as such a server would); chat says so once and
    continues the text through /v1/completions."""
    refusing = "{{ raise_exception('this model has no chat template') }}"
    server_args = [str(stories), "--backend", "torch", "--chat-template", refusing]
    with running_server(server_args, env={"OMP_NUM_THREADS": "1"}) as url:
        prompt = PROMPTS[1]
        result = chat_piped(["--url", url, "--max-tokens", str(MAX_TOKENS)], prompt, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_answers[prompt] + "\n"
    stderr = one_line(result.stderr)
    assert "The server refused chat messages" in stderr
    assert stderr.count("no chat template: plain continuation mode") == 1
