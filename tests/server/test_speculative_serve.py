"""A real ``llmctl serve --speculative-method ngram`` (torch, stories260K) beside the
shared plain server: greedy completions through the ``openai`` client are the same text
and token counts, stop strings cut at the same place, /metrics counts the proposed and
accepted tokens, in all and by position, and a client leaving mid-speculation gives
every KV block back."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import STORIES
from tests.helpers.server_process import running_server
from tests.server.conftest import API_KEY, QUIET_THREADS, Server, stories_or_skip

PROMPTS = [
    "Once upon a time, there was a little girl. Once upon a time, there was a little",
    "Tom had a red ball. Tom had a red ball. Tom had a",
    "The sun was hot.",
]


@pytest.fixture(scope="module")
def ngram_url() -> Iterator[str]:
    stories_or_skip()
    args = [str(STORIES), "--backend", "torch", "--api-key", API_KEY]
    args += ["--cache-block-seq-len", "16", "--speculative-method", "ngram", "--ngram-min", "1"]
    with running_server(args, env=QUIET_THREADS) as url:
        yield url


def complete(base_url: str, prompt: str, **extra) -> tuple[str, int, str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    result = client.completions.create(
        model=model, prompt=prompt, max_tokens=40, temperature=0, **extra
    )
    choice = result.choices[0]
    return choice.text, result.usage.completion_tokens, choice.finish_reason


def metric(url: str, pattern: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{pattern} (\S+)$", text, re.M)
    assert found is not None, f"{pattern} not in /metrics"
    return float(found[1])


def test_ngram_server_answers_as_the_plain_one_and_counts_acceptance(
    server: Server, ngram_url: str
) -> None:
    for prompt in PROMPTS:
        assert complete(ngram_url, prompt) == complete(server.url, prompt)
        want = complete(server.url, prompt, stop=[" the"])
        assert complete(ngram_url, prompt, stop=[" the"]) == want
    proposed = metric(ngram_url, "llmctl_spec_decode_proposed_tokens_total")
    accepted = metric(ngram_url, "llmctl_spec_decode_accepted_tokens_total")
    assert proposed > 0 and 0 < accepted <= proposed
    first = metric(
        ngram_url, r'llmctl_spec_decode_accepted_tokens_by_position_total\{position="0"\}'
    )
    assert 0 < first <= accepted


def test_leaving_mid_speculation_frees_every_block(ngram_url: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    proposed = metric(ngram_url, "llmctl_spec_decode_proposed_tokens_total")
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=ngram_url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            events = response.iter_lines()
            received = [line for line, _ in zip(events, range(8)) if line.startswith("data:")]
            assert len(received) >= 3
            assert metric(ngram_url, "llmctl_kv_blocks_used") > 0
        # leaving the block closes the connection mid-stream
    assert metric(ngram_url, "llmctl_spec_decode_proposed_tokens_total") > proposed
    deadline = time.monotonic() + 30
    while metric(ngram_url, "llmctl_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(ngram_url, "llmctl_kv_blocks_used") == 0
    assert metric(ngram_url, "llmctl_num_requests_running") == 0
