"""End to end: ``llmctl serve --backend openai-proxy`` in front of a second ``llmctl serve``
on stories260K answers exactly as the upstream does, streaming and not, and turns upstream
failures into OpenAI-shaped errors (400 for the client's mistakes, 502 for the upstream's).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import STORIES
from tests.helpers.cli import run_llmctl
from tests.helpers.server_process import ServerProcess
from tests.plugins.conftest import (
    UPSTREAM_KEY,
    metric,
    require_plugin_installed,
    require_stories,
    start_proxy,
)

MODEL = str(STORIES)  # what the upstream serves, and so what the proxy serves by default


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


def both(upstream: ServerProcess, proxy: ServerProcess) -> list[openai.OpenAI]:
    return [client(upstream.url, UPSTREAM_KEY), client(proxy.url)]


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    """transformers' greedy continuations of stories260K (48 new tokens each)."""
    require_stories()
    return json.loads((STORIES / "reference_greedy.json").read_text())["results"]


def test_proxy_serves_the_upstream_model(proxy: ServerProcess) -> None:
    cards = httpx.get(f"{proxy.url}/v1/models", timeout=30).json()["data"]
    assert [card["id"] for card in cards] == [MODEL]
    assert cards[0]["max_model_len"] == 512  # taken from the upstream's model card


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_completion_equals_upstream(
    upstream: ServerProcess, proxy: ServerProcess, reference: list[dict], stream: bool
) -> None:
    case = reference[1]
    answers = []
    for api in both(upstream, proxy):
        if stream:
            chunks = list(
                api.completions.create(
                    model=MODEL,
                    prompt=case["prompt"],
                    max_tokens=48,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            result = api.completions.create(
                model=MODEL, prompt=case["prompt"], max_tokens=48, temperature=0
            )
            text, finish, usage = (
                result.choices[0].text,
                result.choices[0].finish_reason,
                result.usage,
            )
        answers.append((text, finish, usage.prompt_tokens, usage.completion_tokens))
    assert answers[1] == answers[0]
    assert case["prompt"] + answers[1][0] == case["full_text"]  # and both equal transformers
    assert answers[1][1:] == ("length", len(case["prompt_ids"]), 48)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_chat_equals_upstream(
    upstream: ServerProcess, proxy: ServerProcess, stream: bool
) -> None:
    messages = [{"role": "user", "content": "Tom had a red ball."}]
    answers = []
    for api in both(upstream, proxy):
        if stream:
            chunks = list(
                api.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            result = api.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=24, temperature=0
            )
            text, finish = result.choices[0].message.content, result.choices[0].finish_reason
        answers.append((text, finish))
    assert answers[0][0]  # not trivially equal
    assert answers[1] == answers[0]


def test_chat_command_uses_the_upstream(upstream: ServerProcess) -> None:
    """`llmctl chat --backend openai-proxy`, piped: one greedy answer, the upstream's."""
    require_plugin_installed()
    message = "Tom had a red ball."
    expected = client(upstream.url, UPSTREAM_KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": message}], max_tokens=24, temperature=0
    )
    args = ("--backend", "openai-proxy", "--proxy-url", upstream.url, "--max-tokens", "24")
    result = run_llmctl(
        "chat", *args, stdin=message + "\n", env={"LLMCTL_PROXY_API_KEY": UPSTREAM_KEY}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.choices[0].message.content.strip()


def test_sampling_parameters_and_logprobs_reach_the_upstream(
    upstream: ServerProcess, proxy: ServerProcess
) -> None:
    """Seeded sampling with llmctl's extensions (top_k, repetition_penalty) and logprobs:
    identical through the proxy only if every field was forwarded."""
    request = {
        "model": MODEL,
        "prompt": "The cat",
        "max_tokens": 12,
        "temperature": 1.3,
        "top_p": 0.9,
        "seed": 1234,
        "logprobs": 2,
        "extra_body": {"top_k": 7, "repetition_penalty": 1.2},
    }
    results = [api.completions.create(**request) for api in both(upstream, proxy)]
    via_upstream, via_proxy = (r.choices[0] for r in results)
    assert via_proxy.text == via_upstream.text
    assert via_proxy.logprobs.tokens == via_upstream.logprobs.tokens
    # floats survive the JSON round trip exactly, so even the logprobs are equal
    assert via_proxy.logprobs.token_logprobs == via_upstream.logprobs.token_logprobs
    assert via_proxy.logprobs.top_logprobs == via_upstream.logprobs.top_logprobs
    unseeded = client(upstream.url, UPSTREAM_KEY).completions.create(
        **{**request, "seed": 99, "extra_body": {}}
    )
    assert unseeded.choices[0].text != via_upstream.text  # the parameters do matter

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    upstream_chat, proxy_chat = (
        api.chat.completions.create(**chat) for api in both(upstream, proxy)
    )
    assert proxy_chat.choices[0].logprobs == upstream_chat.choices[0].logprobs


def test_upstream_refusal_is_a_400_with_its_message(
    upstream: ServerProcess, proxy: ServerProcess
) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 600}
    direct = httpx.post(
        f"{upstream.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {UPSTREAM_KEY}"},
        timeout=30,
    )
    proxied = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
    assert direct.status_code == proxied.status_code == 400
    assert proxied.json()["error"]["message"] == direct.json()["error"]["message"]
    assert "session_len 512" in proxied.json()["error"]["message"]


def test_client_leaving_mid_stream_aborts_the_upstream_request(
    upstream: ServerProcess, proxy: ServerProcess
) -> None:
    aborted_before = metric(upstream.url, "llmctl_request_finished_total", '{reason="abort"}')
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i == 4:
                break  # leave after a few tokens: closes the connection
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = metric(upstream.url, "llmctl_request_finished_total", '{reason="abort"}')
        idle = metric(upstream.url, "llmctl_num_requests_running") == 0
        if done > aborted_before and idle and metric(proxy.url, "llmctl_num_requests_running") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the upstream kept generating after the proxy's client left")
    assert metric(upstream.url, "llmctl_kv_blocks_used") == 0


def test_upstream_down_is_a_502_and_a_check_reason(upstream: ServerProcess) -> None:
    # An upstream this test may stop: itself a proxy in front of the shared one (it starts
    # in seconds, where a second model server would load a model).
    middle = start_proxy(upstream.url)
    try:
        front = start_proxy(middle.url)
    except BaseException:
        middle.stop()
        raise
    try:
        assert client(front.url).completions.create(model=MODEL, prompt="Once", max_tokens=2)
        middle.stop()
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
        for stream in (False, True):
            answer = httpx.post(
                f"{front.url}/v1/completions", json={**body, "stream": stream}, timeout=30
            )
            assert answer.status_code == 502
            error = answer.json()["error"]
            assert error["type"] == "upstream_error"
            assert f"upstream {middle.url}/v1 is unreachable" in error["message"]
        assert httpx.get(f"{front.url}/health", timeout=10).status_code == 200  # still serving
    finally:
        front.stop()
        middle.stop()

    # Other backends' checks are not under test here (turbo's builds native code).
    only_proxy = {"LLMCTL_PLUGINS": "openai-proxy"}
    args = ("--backend", "openai-proxy", "--proxy-url", middle.url)
    check = run_llmctl("backends", "check", "demo", *args, env=only_proxy)
    assert check.returncode == 1
    assert "✗ openai-proxy cannot serve" in check.stdout
    assert f"upstream {middle.url}/v1 is unreachable" in check.stdout

    serve = run_llmctl("serve", *args, env=only_proxy)
    assert serve.returncode == 1
    assert f"upstream {middle.url}/v1 is unreachable" in serve.stderr
    assert "Traceback" not in serve.stderr
