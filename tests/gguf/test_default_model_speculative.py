"""Speculative decoding on the default model, SmolLM2-135M-Instruct (its 49k-token BPE
vocabulary and real weights, where near-ties are rarer than on random models): greedy
answers with n-gram proposals equal those without, token for token, on turbo (the file's
Q4_1 blocks run natively) and on the torch backend (dequantized); with the model itself as
the draft, every proposal is accepted. The prompts ask for text that repeats the prompt's
(prompt lookup's workload), and one that does not."""

from __future__ import annotations

import pytest

from llmctl import LLM, SamplingParams

LIST = "apples, pears, plums, figs, dates, limes, lemons, grapes, melons, kiwis"
MESSAGES = [
    [{"role": "user", "content": f"Repeat this list exactly, in capitals: {LIST}."}],
    [{"role": "user", "content": f"Copy this list, then add one fruit: {LIST}."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
PARAMS = SamplingParams(max_tokens=40, temperature=0)


def answers(llm: LLM) -> list[list[int]]:
    tokens = [o.token_ids for o in llm.chat(MESSAGES, PARAMS)]
    assert llm.engine.stats().kv_blocks_used == 0
    return tokens


@pytest.mark.parametrize(("backend", "quantization"), [("turbo", "gguf"), ("torch", "none")])
def test_ngram_and_draft_greedy_answers_equal_plain_decoding(smollm2, backend, quantization):
    common = dict(backend=backend, quantization=quantization, dtype="float32", session_len=512)
    with LLM(str(smollm2), **common) as llm:
        want = answers(llm)
    with LLM(str(smollm2), **common, speculative_method="ngram", num_speculative_tokens=4) as llm:
        assert answers(llm) == want
        stats = llm.engine.engine.speculator.stats
        assert stats.accepted > 0  # the lists were proposed from the prompt and kept
    if backend == "turbo":
        with LLM(
            str(smollm2), **common, speculative_method="draft", speculative_model=str(smollm2),
            num_speculative_tokens=3,
        ) as llm:  # fmt: skip
            assert answers(llm) == want
            stats = llm.engine.engine.speculator.stats
            assert stats.proposed > 0 and stats.accepted == stats.proposed
