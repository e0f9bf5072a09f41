"""32 streaming requests at once all complete, with the same greedy text as one at a time."""

from __future__ import annotations

import asyncio

import openai

from tests.server.conftest import Server

SUBJECTS = ["Once upon a time", "Lily and Ben", "The little dog", "Tom had a red ball"]
ENDINGS = ["", " and", " One day,", " She was very"]


def prompts() -> list[tuple[str, int]]:
    """32 different prompts, each with its own max_tokens, so lengths differ in the batch."""
    texts = [s + e for s in SUBJECTS for e in ENDINGS]
    texts += [t + " happy." for t in texts]
    return [(text, 8 + (i * 5) % 17) for i, text in enumerate(texts)]


async def stream_one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int):
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return "".join(text), finish, usage.completion_tokens


def test_32_concurrent_streams_equal_sequential_runs(server: Server) -> None:
    cases = prompts()
    assert len(cases) == 32 and len({p for p, _ in cases}) == 32

    async def run() -> tuple[list, list]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120
        )
        model = (await client.models.list()).data[0].id
        one_at_a_time = [await stream_one(client, model, p, n) for p, n in cases]
        together = await asyncio.gather(*(stream_one(client, model, p, n) for p, n in cases))
        await client.close()
        return one_at_a_time, together

    one_at_a_time, together = asyncio.run(run())
    assert together == one_at_a_time
    for (_, max_tokens), (_, finish, tokens) in zip(cases, together):
        assert finish in ("stop", "length")
        assert tokens == max_tokens or finish == "stop"
    assert server.metric("llmctl_num_requests_running") == 0
