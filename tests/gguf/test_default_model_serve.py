"""The default model where no model is named: through a real ``llmctl serve`` (the
``openai`` client's chat completion), ``LLM()`` and ``llmctl chat``, it answers a question
as SmolLM2-135M-Instruct does."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.server_process import running_server


@pytest.mark.parametrize("backend", ["torch", "turbo"])
def test_the_default_model_knows_the_capital_of_france(smollm2, backend):
    with running_server(["--backend", backend, "--session-len", "1024"]) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        [card] = client.models.list().data
        assert card.id == "smollm2-135m"
        answer = client.chat.completions.create(
            model=card.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
    assert "Paris" in answer.choices[0].message.content, answer


def test_llm_with_no_model_answers_with_the_default_model(smollm2):
    from llmctl import LLM, SamplingParams

    question = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(backend="torch", session_len=512, cache_max_entry_count="64") as llm:
        [answer] = llm.chat(question, SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in answer.text, answer.text


def test_chat_with_no_model_answers_with_the_default_model(smollm2):
    from llmctl.paths import cache_dir
    from tests.chat.run_chat import chat_piped

    result = chat_piped(  # the usual cache dir: a fresh one would rebuild turbo's ops
        ["--backend", "torch", "--temperature", "0", "--session-len", "512"],
        "What is the capital of France?\n",
        cache_dir(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Paris" in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("backend", ["torch", "turbo"])
def test_int8_weights_from_the_dequantized_file_still_answer(smollm2, backend):
    from llmctl import LLM, SamplingParams

    question = [{"role": "user", "content": "What is the capital of France?"}]
    options = dict(session_len=512, cache_max_entry_count="64", quantization="int8")
    with LLM(backend=backend, device="cpu", **options) as llm:
        [answer] = llm.chat(question, SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in answer.text, answer.text
