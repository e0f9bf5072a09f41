"""A real ``llmctl serve --speculative-method ngram`` (torch, stories260K) beside the
shared plain server: greedy completions through the ``openai`` client are the same text
and token counts, stop strings cut at the same place, and /metrics counts the proposed
and accepted tokens, in all and by position."""

from __future__ import annotations

import re

import httpx
import openai

from tests.conftest import STORIES
from tests.helpers.server_process import running_server
from tests.server.conftest import API_KEY, QUIET_THREADS, Server

PROMPTS = [
    "Once upon a time, there was a little girl. Once upon a time, there was a little",
    "Tom had a red ball. Tom had a red ball. Tom had a",
    "The sun was hot.",
]


def complete(base_url: str, prompt: str, **extra) -> tuple[str, int, str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    result = client.completions.create(
        model=model, prompt=prompt, max_tokens=40, temperature=0, **extra
    )
    choice = result.choices[0]
    return choice.text, result.usage.completion_tokens, choice.finish_reason


def test_ngram_server_answers_as_the_plain_one_and_counts_acceptance(server: Server) -> None:
    args = [str(STORIES), "--backend", "torch", "--api-key", API_KEY, "--cache-block-seq-len", "16"]
    args += ["--speculative-method", "ngram", "--ngram-min", "1"]
    with running_server(args, env=QUIET_THREADS) as url:
        for prompt in PROMPTS:
            assert complete(url, prompt) == complete(server.url, prompt)
            want = complete(server.url, prompt, stop=[" the"])
            assert complete(url, prompt, stop=[" the"]) == want
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    proposed = float(
        re.search(r"^llmctl_spec_decode_proposed_tokens_total (\S+)$", metrics, re.M)[1]
    )
    accepted = float(
        re.search(r"^llmctl_spec_decode_accepted_tokens_total (\S+)$", metrics, re.M)[1]
    )
    assert proposed > 0 and 0 < accepted <= proposed
    first = re.search(
        r'^llmctl_spec_decode_accepted_tokens_by_position_total\{position="0"\} (\S+)$',
        metrics,
        re.M,
    )
    assert first is not None and 0 < float(first[1]) <= accepted
