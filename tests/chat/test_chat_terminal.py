"""``llmctl chat`` in a real pseudo-terminal: in-process engine and ``--url`` server."""

from __future__ import annotations

from pathlib import Path

import pexpect

from tests.chat.conftest import API_KEY
from tests.chat.run_chat import PROMPT, converse, spawn_chat


def test_chat_in_process(stories: Path, tmp_path: Path) -> None:
    chat = spawn_chat([str(stories), "--backend", "torch", "--max-tokens", "24"], tmp_path)
    try:
        chat.expect(r"has no chat template: plain continuation mode")
        transcript = converse(chat, tmp_path, idle_stats=r"requests running: 0\r?\n")
        # Ctrl-C at the prompt drops the line being typed and stays.
        chat.send("half a line")
        # As a person would: Ctrl-C once the line is on screen. (A SIGINT that lands
        # before readline waits for input is only seen at the next key press.)
        chat.expect_exact("half a line")
        chat.sendintr()
        chat.expect_exact("(Ctrl-D or /exit leaves)")
        chat.expect_exact(PROMPT)
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0

    assert transcript["mode"] == "continuation"
    assert transcript["sampling"]["temperature"] == 0.0
    assert transcript["sampling"]["max_tokens"] == 480
    # /reset dropped the first exchange; the stopped answer keeps what was shown.
    user, assistant = transcript["messages"]
    assert user == {"role": "user", "content": "Once upon a time"}
    assert assistant["content"].startswith(", there was a little girl named Lily.")
    # Line-editing history is kept between sessions.
    history = (tmp_path / "chat_history").read_text()
    assert "/set temperature 0" in history


def test_chat_with_url(stories: Path, stories_server: str, tmp_path: Path) -> None:
    args = ["--url", stories_server, "--api-key", API_KEY, "--max-tokens", "24"]
    chat = spawn_chat(args, tmp_path)
    try:
        chat.expect_exact(f"Chatting with {stories} at {stories_server}")
        transcript = converse(chat, tmp_path, idle_stats=r"llmctl_num_requests_running: 0\.0")
        chat.sendeof()  # Ctrl-D leaves too
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0

    assert transcript["model"] == str(stories)
    user, assistant = transcript["messages"]
    assert user == {"role": "user", "content": "Once upon a time"}
    assert assistant["content"].startswith(", there was a little girl named Lily.")
