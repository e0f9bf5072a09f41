"""The OpenAI API through the official ``openai`` client (sync, async, streaming) and httpx,
against a real ``llmctl serve`` on stories260K, checked against transformers' greedy text
(``reference_greedy.json``)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.conftest import STORIES
from tests.server.conftest import SESSION_LEN, Server


def sync_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return sync_client(server).models.list().data[0].id


def test_models_lists_the_served_model(server: Server) -> None:
    with server.client() as http:
        body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [str(STORIES)]
    assert body["data"][0]["max_model_len"] == SESSION_LEN


def test_greedy_completion_equals_transformers(
    server: Server, model: str, reference: list[dict]
) -> None:
    client = sync_client(server)
    for case in reference[:3]:
        result = client.completions.create(
            model=model, prompt=case["prompt"], max_tokens=48, temperature=0
        )
        choice = result.choices[0]
        assert case["prompt"] + choice.text == case["full_text"]
        assert choice.finish_reason == "length"
        assert result.usage.prompt_tokens == len(case["prompt_ids"])
        assert result.usage.completion_tokens == 48
        assert result.usage.total_tokens == len(case["prompt_ids"]) + 48


def test_batched_token_id_prompts(server: Server, model: str, reference: list[dict]) -> None:
    cases = reference[:2]
    result = sync_client(server).completions.create(
        model=model, prompt=[c["prompt_ids"] for c in cases], max_tokens=48, temperature=0
    )
    assert [c.index for c in result.choices] == [0, 1]
    for case, choice in zip(cases, result.choices):
        assert case["prompt"] + choice.text == case["full_text"]
    assert result.usage.prompt_tokens == sum(len(c["prompt_ids"]) for c in cases)
    assert result.usage.completion_tokens == 96


def test_streamed_completion_equals_whole_one(
    server: Server, model: str, reference: list[dict]
) -> None:
    case = reference[1]
    chunks = list(
        sync_client(server).completions.create(
            model=model,
            prompt=case["prompt"],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    text = "".join(c.choices[0].text for c in text_chunks)
    assert len(text_chunks) > 1, "the text should arrive in several chunks"
    assert case["full_text"].startswith(case["prompt"] + text)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == len(case["prompt_ids"])


def test_whole_response_is_the_stream_joined_past_its_output_interval(
    server: Server, model: str, reference: list[dict]
) -> None:
    """A response not streamed takes the engine's outputs 16 tokens at a time
    (WHOLE_RESPONSE_INTERVAL); over 45 tokens its text and logprobs are the stream's."""
    case, client = reference[0], sync_client(server)
    asked = dict(model=model, prompt=case["prompt"], max_tokens=45, temperature=0, logprobs=2)
    whole = client.completions.create(**asked).choices[0]
    chunks = [c for c in client.completions.create(**asked, stream=True) if c.choices]
    streamed = [c.choices[0] for c in chunks]
    assert whole.text == "".join(choice.text for choice in streamed)
    tokens = [t for choice in streamed for t in choice.logprobs.tokens]
    values = [v for choice in streamed for v in choice.logprobs.token_logprobs]
    assert whole.logprobs.tokens == tokens and len(tokens) == 45
    assert whole.logprobs.token_logprobs == pytest.approx(values)
    assert whole.finish_reason == streamed[-1].finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(
    server: Server, model: str, reference: list[dict], n: int
) -> None:
    """vLLM's extra: each chunk's usage counts the tokens sent up to it, so a client that
    stops reading knows its count; the last chunk is still the whole usage."""
    case = reference[0]
    chunks = list(
        sync_client(server).completions.create(
            model=model,
            prompt=case["prompt"],
            max_tokens=12,
            temperature=0,
            n=n,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    prompt_tokens = len(case["prompt_ids"])
    counts = [chunk.usage.completion_tokens for chunk in text_chunks]
    for chunk in text_chunks:
        assert chunk.usage.prompt_tokens == prompt_tokens
        assert chunk.usage.total_tokens == prompt_tokens + chunk.usage.completion_tokens
    # From the first token, growing with the chunks, to the whole count.
    assert counts[0] >= 1 and counts == sorted(counts) and counts[-1] == 12 * n
    assert len(set(counts)) > 2  # counted as they came, not only at the end
    assert usage_chunk.usage.completion_tokens == 12 * n


def test_async_chat_streaming_and_whole(server: Server, model: str, reference: list[dict]) -> None:
    """stories260K has no chat template: the engine continues the message text."""
    case = reference[0]
    messages = [{"role": "user", "content": case["prompt"]}]

    async def run() -> tuple[str, str, list[str | None]]:
        client = async_client(server)
        whole = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=48, temperature=0
        )
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=48, temperature=0, stream=True
        )
        deltas, reasons = [], []
        async for chunk in stream:
            deltas.append(chunk.choices[0].delta)
            reasons.append(chunk.choices[0].finish_reason)
        assert deltas[0].role == "assistant"
        assert whole.choices[0].message.role == "assistant"
        assert whole.usage.completion_tokens == 48
        return whole.choices[0].message.content, "".join(d.content or "" for d in deltas), reasons

    whole_text, streamed_text, reasons = asyncio.run(run())
    assert case["prompt"] + whole_text == case["full_text"]
    assert streamed_text == whole_text
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


def test_completion_logprobs_legacy_shape(server: Server, model: str) -> None:
    result = sync_client(server).completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 6
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0
        assert 3 <= len(top) <= 4  # the 3 most likely, plus the sampled token if not among them
        assert top[token] == logprob
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_chat_logprobs_shape(server: Server, model: str) -> None:
    result = sync_client(server).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Lily and Ben"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_n_choices_with_a_seed_reproduce(server: Server, model: str) -> None:
    client = sync_client(server)
    prompt_tokens = client.completions.create(model=model, prompt="The cat", max_tokens=1)
    prompt_tokens = prompt_tokens.usage.prompt_tokens

    def sample() -> list[str]:
        result = client.completions.create(
            model=model, prompt="The cat", max_tokens=12, temperature=1.0, n=3, seed=7, logprobs=0
        )
        assert [c.index for c in result.choices] == [0, 1, 2]
        # each choice counted: its logprobs list one entry per generated token
        assert result.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in result.choices)
        assert result.usage.prompt_tokens == prompt_tokens  # one prompt, counted once
        return [c.text for c in result.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1, "choices with seeds 7, 8, 9 should differ"


def test_stop_string_cuts_the_text(server: Server, model: str, reference: list[dict]) -> None:
    case = reference[0]  # "... a little girl named Lily. She loved to play ..."
    result = sync_client(server).completions.create(
        model=model, prompt=case["prompt"], max_tokens=48, temperature=0, stop=[" named"]
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert case["prompt"] + choice.text + " named" in case["full_text"]
    assert " named" not in choice.text


def test_open_endpoints_need_no_key(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    version = httpx.get(f"{server.url}/version").json()
    assert version["backend"] == "torch" and version["version"]
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200
    assert "llmctl_kv_blocks_free" in metrics.text


def test_prompts_stay_out_of_the_log_by_default(server: Server, model: str) -> None:
    secret = "The purple zebra whispered"
    sync_client(server).completions.create(model=model, prompt=secret, max_tokens=2)
    log = server.process.log()
    assert "2 generated tokens" in log  # sizes are logged...
    assert secret not in log  # ...the prompt is not
