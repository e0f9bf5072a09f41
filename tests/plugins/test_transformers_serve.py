"""End to end: ``llmctl serve`` on a tiny random GPT-2, which only the transformers backend
can serve, answers the ``openai`` client's chat (through the chat template given by
``--chat-template``) and completions, streamed and not, with transformers' own greedy
tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmctl.backend import SamplingParams
from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.model.tokenizer import Tokenizer
from tests.helpers.server_process import ServerProcess, start_server
from tests.helpers.tiny_models import hf_greedy, load_hf_model
from tests.plugins.conftest import require_transformers_plugin

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def gpt2(tiny_non_llama) -> Path:
    return tiny_non_llama("gpt2")


@pytest.fixture(scope="module")
def server(gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`llmctl serve` with `--backend auto` (the default): it must pick transformers."""
    require_transformers_plugin()
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    process = start_server(
        [str(gpt2), "--chat-template", str(template), "--max-batch-size", "8"],
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def api(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(gpt2: Path):
    """``reference(prompt_ids)`` -> (text, tokens): transformers' greedy continuation as
    llmctl's detokenizer renders it."""
    model = load_hf_model(gpt2)
    tokenizer = Tokenizer.from_dir(gpt2)

    def greedy(prompt_ids: list[int]) -> tuple[str, int]:
        tokens = hf_greedy(model, [prompt_ids], MAX_TOKENS)[0]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
        for token in tokens:
            detokenizer.add_token(token)
        return detokenizer.take_new_text(final=True), len(tokens)

    return greedy


def test_auto_chose_transformers_and_said_why(server: ServerProcess) -> None:
    log = " ".join(server.log().split())
    assert "backend transformers chosen" in log
    assert "turbo skipped: architecture GPT2LMHeadModel is not supported" in log
    assert "torch skipped: architecture GPT2LMHeadModel is not supported" in log


def test_model_card_states_the_context_length(api: openai.OpenAI, gpt2: Path) -> None:
    cards = api.models.list().data
    assert [card.id for card in cards] == [str(gpt2)]
    assert cards[0].model_extra["max_model_len"] == 256  # GPT-2's n_positions


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_is_transformers_greedy_output(
    api: openai.OpenAI, gpt2: Path, reference, stream: bool
) -> None:
    prompt = "Once upon a time"
    prompt_ids = Tokenizer.from_dir(gpt2).encode(prompt)
    expected_text, expected_tokens = reference(prompt_ids)
    assert expected_text  # not trivially equal
    request = dict(model=str(gpt2), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = list(
            api.completions.create(**request, stream=True, stream_options={"include_usage": True})
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # it streamed
    else:
        result = api.completions.create(**request)
        text, usage = result.choices[0].text, result.usage
    assert text == expected_text
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), expected_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_goes_through_the_given_template(
    api: openai.OpenAI, gpt2: Path, reference, stream: bool
) -> None:
    messages = [{"role": "user", "content": "Tom had a red ball."}]
    rendered = "<|user|>Tom had a red ball.\n<|assistant|>"
    prompt_ids = Tokenizer.from_dir(gpt2).encode(rendered, add_special_tokens=False)
    expected_text, expected_tokens = reference(prompt_ids)
    request = dict(model=str(gpt2), messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = list(
            api.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        result = api.chat.completions.create(**request)
        text, usage = result.choices[0].message.content, result.usage
    assert text == expected_text
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), expected_tokens)


def test_a_parameter_transformers_cannot_honour_is_a_400(api: openai.OpenAI, gpt2: Path) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        api.completions.create(model=str(gpt2), prompt="Hi", max_tokens=4, presence_penalty=0.5)
    assert "cannot honour presence_penalty=0.5" in str(exc.value)
    # ... and the server goes on serving.
    assert api.completions.create(model=str(gpt2), prompt="Hi", max_tokens=2).usage
