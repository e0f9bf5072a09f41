"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, and
``usage.prompt_tokens_details.cached_tokens`` from prefix-cache hits, through a real
``llmctl serve demo``."""

from __future__ import annotations

import httpx
import openai

from llmctl.model.demo import materialize_demo
from llmctl.model.tokenizer import Tokenizer
from tests.server.conftest import HERMES_TEMPLATE


def test_tokenize_and_detokenize_round_trip(demo_url) -> None:
    root = demo_url.removesuffix("/v1")
    text = "Once upon a time, 世界 🙂"
    reference = Tokenizer.from_dir(materialize_demo())
    answer = httpx.post(f"{root}/tokenize", json={"prompt": text, "return_token_strs": True})
    assert answer.status_code == 200
    body = answer.json()
    assert body["tokens"] == reference.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == [reference.token_text(t) for t in body["tokens"]]
    back = httpx.post(f"{root}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenize_messages_is_the_chat_prompt(demo_url) -> None:
    root = demo_url.removesuffix("/v1")
    messages = [{"role": "user", "content": "Hi there"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = httpx.post(f"{root}/tokenize", json={"messages": messages, "tools": tools}).json()
    reference = Tokenizer.from_dir(materialize_demo(), chat_template=str(HERMES_TEMPLATE))
    rendered = reference.apply_chat_template(messages, True, tools)
    assert body["tokens"] == reference.encode(rendered, add_special_tokens=False)
    client = openai.OpenAI(base_url=demo_url, api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="demo", messages=messages, tools=tools, tool_choice="none", max_tokens=1
    )
    assert chat.usage.prompt_tokens == body["count"]


def test_bad_tokenize_requests_are_400s(demo_url) -> None:
    root = demo_url.removesuffix("/v1")
    both = httpx.post(f"{root}/tokenize", json={"prompt": "a", "messages": [{"role": "user"}]})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    outside = httpx.post(f"{root}/detokenize", json={"tokens": [1, 99999]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"


def test_cached_tokens_count_prefix_cache_hits(demo_url) -> None:
    client = openai.OpenAI(base_url=demo_url, api_key="none", max_retries=0)
    prompt = "A prompt long enough to fill several KV blocks of the cache. " * 8
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="demo", prompt=prompt + "Again?", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole blocks of the shared prefix (64 tokens each, the default block size).
    assert cached > 0 and cached % 64 == 0 and cached <= first.usage.prompt_tokens


def test_echo_starts_each_choice_with_its_prompt(demo_url) -> None:
    client = openai.OpenAI(base_url=demo_url, api_key="none", max_retries=0)
    plain = dict(model="demo", max_tokens=5, temperature=0)
    alone = client.completions.create(prompt="Once upon", **plain).choices[0].text
    echoed = client.completions.create(prompt=["Once upon", "A"], echo=True, **plain)
    assert echoed.choices[0].text == "Once upon" + alone
    assert echoed.choices[1].text.startswith("A")
    ids = Tokenizer.from_dir(materialize_demo()).encode("Hi there", add_special_tokens=False)
    by_ids = client.completions.create(prompt=ids, echo=True, **plain).choices[0].text
    assert by_ids.startswith("Hi there")
    stream = client.completions.create(prompt="Once upon", echo=True, stream=True, **plain)
    assert "".join(chunk.choices[0].text for chunk in stream) == "Once upon" + alone
