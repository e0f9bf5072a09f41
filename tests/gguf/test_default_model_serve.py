"""The default model through a real ``llmctl serve`` (no model named): the ``openai``
client's chat completion answers a question as SmolLM2-135M-Instruct does."""

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
