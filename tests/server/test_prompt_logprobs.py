"""``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` on /v1/completions, through a
real ``llmctl serve demo`` on each native backend and the ``openai`` client, against
transformers' log_softmax on the same weights: what lm-evaluation-harness reads for a
loglikelihood (the continuation's token logprobs, whether each is the greedy token)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from llmctl.model.demo import materialize_demo
from llmctl.model.tokenizer import Tokenizer
from tests.helpers.server_process import start_server
from tests.helpers.tiny_models import load_hf_model
from tests.server.conftest import QUIET_THREADS

TOP = 2


@pytest.fixture(scope="module", params=["torch", "turbo"])
def client(request) -> Iterator[openai.OpenAI]:
    process = start_server(
        ["demo", "--backend", request.param, "--cache-block-seq-len", "16"], env=QUIET_THREADS
    )
    try:
        yield openai.OpenAI(base_url=f"{process.url}/v1", api_key="none", max_retries=0)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def model():
    return load_hf_model(materialize_demo())


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(materialize_demo())


def reference(model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]`` log-probabilities: row j scores token j + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(length)]


def test_echo_logprobs_equal_transformers(client, model, tokenizer) -> None:
    prompt = random_prompt(1, 40)
    want = reference(model, prompt)
    answer = client.completions.create(
        model="demo", prompt=prompt, echo=True, logprobs=TOP, max_tokens=3, temperature=0
    )
    choice = answer.choices[0]
    logprobs = choice.logprobs
    # The prompt's tokens lead, then the 3 generated ones.
    assert len(logprobs.tokens) == len(prompt) + 3
    assert logprobs.tokens[: len(prompt)] == [tokenizer.token_text(t) for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for j, token in enumerate(prompt[1:]):
        row = want[j]
        assert logprobs.token_logprobs[j + 1] == pytest.approx(row[token].item(), abs=2e-4)
        top = logprobs.top_logprobs[j + 1]
        best = row.topk(TOP)
        for token_id, value in zip(best.indices.tolist(), best.values.tolist()):
            assert top[tokenizer.token_text(token_id)] == pytest.approx(value, abs=2e-4)
    assert choice.text.startswith(tokenizer.decode(prompt, skip_special_tokens=False))
    assert logprobs.text_offset[0] == 0
    assert answer.usage.prompt_tokens == len(prompt)
    # Scored prompts take nothing from the prefix cache (a cached block has no logits).
    again = client.completions.create(
        model="demo", prompt=prompt, echo=True, logprobs=TOP, max_tokens=3, temperature=0
    )
    assert again.choices[0].logprobs.token_logprobs == logprobs.token_logprobs
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_loglikelihood_as_lm_eval_asks(client, model) -> None:
    """lm-evaluation-harness' local-completions: echo, logprobs=1, max_tokens=1; it sums
    the continuation's token_logprobs and checks each against the top alternative."""
    context, continuation = random_prompt(2, 25), random_prompt(3, 7)
    prompts = [context + continuation, random_prompt(4, 12)]  # batched, as it sends them
    answer = client.completions.create(
        model="demo", prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    logprobs = answer.choices[0].logprobs
    scores = logprobs.token_logprobs[len(context) : -1]
    want = reference(model, prompts[0])[len(context) - 1 :]
    chosen = want.gather(1, torch.tensor(continuation).unsqueeze(1)).squeeze(1)
    assert sum(scores) == pytest.approx(chosen.sum().item(), abs=1e-3)
    greedy = all(
        max(top, key=top.get) == token
        for top, token in zip(
            logprobs.top_logprobs[len(context) : -1], logprobs.tokens[len(context) : -1]
        )
    )
    assert greedy == bool((want.argmax(dim=1) == torch.tensor(continuation)).all())
    assert len(answer.choices[1].logprobs.tokens) == 12 + 1


def test_vllm_prompt_logprobs_and_streaming(client, model) -> None:
    prompt = random_prompt(5, 30)
    want = reference(model, prompt)
    answer = client.completions.create(
        model="demo",
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 3},
    )
    scores = answer.choices[0].model_extra["prompt_logprobs"]
    assert answer.choices[0].logprobs is None
    assert len(scores) == len(prompt) and scores[0] is None
    for j, token in enumerate(prompt[1:]):
        row, entry = want[j], scores[j + 1]
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=2e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        best = row.topk(3)
        for rank, token_id in enumerate(best.indices.tolist(), 1):
            assert entry[str(token_id)]["rank"] == rank
    # Streamed, the prompt's scores come with the first chunk; joined, the same logprobs.
    whole = client.completions.create(
        model="demo", prompt=prompt, echo=True, logprobs=1, max_tokens=4, temperature=0
    )
    chunks = list(
        client.completions.create(
            model="demo",
            prompt=prompt,
            echo=True,
            logprobs=1,
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    streamed = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_chat_prompt_logprobs_score_the_rendered_prompt(client, model) -> None:
    messages = [{"role": "user", "content": "Score this prompt."}]
    root = str(client.base_url).removesuffix("/v1/")
    prompt = httpx.post(f"{root}/tokenize", json={"messages": messages}).json()["tokens"]
    want = reference(model, prompt)
    answer = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    scores = answer.model_extra["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    for j, token in enumerate(prompt[1:]):
        assert scores[j + 1][str(token)]["logprob"] == pytest.approx(
            want[j][token].item(), abs=2e-4
        )
    with pytest.raises(openai.BadRequestError, match="not available with stream"):
        client.chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=2,
            stream=True,
            extra_body={"prompt_logprobs": 1},
        )


def test_bad_prompt_logprobs_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            model="demo", prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 21}
        )
    ok = client.completions.create(model="demo", prompt="x", max_tokens=1, echo=True, logprobs=0)
    assert ok.choices[0].logprobs.token_logprobs[0] is None
