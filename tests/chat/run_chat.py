"""Run the real ``llmctl chat``: in a pseudo-terminal as a person at a keyboard, or piped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pexpect

from llmctl.paths import cache_dir as llmctl_cache_dir

PROMPT = ">>> "
# The answer line that follows every answer: "12 tokens in 0.31 s, 38.7 tokens/s · ...".
SUMMARY = re.compile(r"(\d+) (tokens|chunks) in [\d.]+ s, [\d.]+ \w+/s([^\r\n]*)")


def chat_env(cache_dir: Path) -> dict[str, str]:
    """The environment for a chat kept under ``cache_dir``: no LLMCTL_* from the test's
    shell, and the suite's turbo build linked in, since on the CPU the torch backend runs
    turbo's attention ops and building them again takes minutes."""
    built = llmctl_cache_dir() / "turbo"
    if built.is_dir() and not (cache_dir / "turbo").exists():
        (cache_dir / "turbo").symlink_to(built, target_is_directory=True)
    return {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}


def spawn_chat(args: list[str], cache_dir: Path, timeout: float = 120) -> pexpect.spawn:
    """``python -m llmctl chat ARGS`` on a pty, with history kept under ``cache_dir``."""
    env = chat_env(cache_dir)
    env.update(LLMCTL_CACHE_DIR=str(cache_dir), NO_COLOR="1", TERM="dumb", OMP_NUM_THREADS="1")
    return pexpect.spawn(
        sys.executable,
        ["-m", "llmctl", "chat", *args],
        env=env,
        encoding="utf-8",
        timeout=timeout,
        dimensions=(50, 200),
    )


def chat_piped(args: list[str], stdin: str, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    """``echo STDIN | python -m llmctl chat ARGS``."""
    env = chat_env(cache_dir)
    env.update(LLMCTL_CACHE_DIR=str(cache_dir), NO_COLOR="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "llmctl", "chat", *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_line(text: str) -> str:
    """Messages as one line: rich wraps them at the terminal's width."""
    return " ".join(text.split())


def command(chat: pexpect.spawn, line: str, expected: str) -> str:
    """Type a slash command, wait for ``expected`` (a regex) and the next prompt."""
    chat.sendline(line)
    chat.expect(expected)
    found = chat.match.group(0)
    chat.expect_exact(PROMPT)
    return found


def assert_goes_idle(chat: pexpect.spawn, idle_stats: str, tries: int = 40) -> None:
    """/stats shows no running request within a few seconds (an abort takes a moment)."""
    for _ in range(tries):
        chat.sendline("/stats")
        busy = chat.expect([idle_stats, r"running: [1-9]"])
        chat.expect_exact(PROMPT)
        if not busy:
            return
        time.sleep(0.25)
    raise AssertionError(f"a request was still running after {tries} looks at /stats")


def converse(chat: pexpect.spawn, tmp_path: Path, *, idle_stats: str) -> dict:
    """The scenario both front ends must pass; returns the saved transcript.

    ``chat`` must have been started with ``--max-tokens 24`` on stories260K, whose greedy
    continuation of "Once upon a time" runs past 480 tokens without an end-of-story
    token, so an answer with max_tokens 480 is surely still streaming when Ctrl-C comes.
    ``idle_stats`` is what /stats shows once the stopped request has been aborted.
    """
    chat.expect_exact(PROMPT)

    # A sampled answer (interactive default temperature 0.7) streams and ends with its
    # token count and speed.
    chat.sendline("Lily and Ben")
    chat.expect(SUMMARY)
    assert int(chat.match.group(1)) <= 24
    chat.expect_exact(PROMPT)

    command(chat, "/set temperature 0", r"temperature = 0\.0")
    command(chat, "/set temperature hot", r"error: temperature must be a number, got 'hot'")
    command(chat, "/set top_p 1.5", r"error: top_p must be in \(0, 1\], got 1\.5")
    command(chat, "/set colour blue", r"error: cannot set 'colour'")
    command(chat, "/reset", r"Conversation cleared\.")
    command(chat, "/set max_tokens 480", r"max_tokens = 480")

    # Ctrl-C in the middle of a long answer stops it; the chat goes on.
    chat.sendline("Once upon a time")
    chat.expect_exact(", there was a little girl named Lily.")
    chat.sendintr()
    chat.expect(SUMMARY)
    tokens, tail = int(chat.match.group(1)), chat.match.group(3)
    assert "stopped" in tail
    assert tokens < 480
    chat.expect_exact(PROMPT)
    assert_goes_idle(chat, idle_stats)  # the stopped request was aborted, not left running

    command(chat, "/bogus", r"error: unknown command /bogus: /help lists the commands")
    command(chat, "/help", r"/save FILE")
    transcript_path = tmp_path / "transcript.json"
    command(chat, f"/save {transcript_path}", r"Saved 2 messages")
    return json.loads(transcript_path.read_text())
