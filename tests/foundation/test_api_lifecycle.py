"""The Python API's edges: empty inputs return at once, an LLM is a context manager, and
one dropped without ``shutdown()`` still stops its engine."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import pytest

from llmctl import LLM, SamplingParams
from llmctl.errors import InvalidRequest


def within(seconds: float, call):
    """``call()``'s result, or a test failure if it has not returned in ``seconds``."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        pytest.fail(f"still waiting after {seconds} s")
    return result[0]


@pytest.fixture(scope="module")
def llm():
    with LLM("demo", backend="torch", device="cpu", dtype="float32") as llm:
        yield llm


@pytest.mark.parametrize(
    "call",
    [
        lambda llm: llm.generate([]),
        lambda llm: llm.generate([], SamplingParams(max_tokens=3)),
        lambda llm: llm.generate([], []),
        lambda llm: llm.chat([]),
        lambda llm: llm.engine.generate_all([]),
    ],
    ids=["generate", "generate-with-params", "generate-params-list", "chat", "generate_all"],
)
def test_nothing_to_do_returns_an_empty_list_at_once(llm, call):
    assert within(10, lambda: call(llm)) == []
    # ... and the engine still serves afterwards
    assert len(llm.generate(["a b"], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_a_dropped_llm_stops_its_engine_thread():
    llm = LLM("demo", backend="torch", device="cpu", dtype="float32")
    thread = llm.engine._thread
    assert thread.is_alive()
    del llm
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_with_block_shuts_down_and_shutdown_twice_is_fine():
    with LLM("demo", backend="torch", device="cpu", dtype="float32") as llm:
        thread = llm.engine._thread
        assert llm.generate("x", SamplingParams(max_tokens=1))[0].token_ids
    assert not thread.is_alive()
    llm.shutdown()


@pytest.mark.parametrize("backend", ["torch", "turbo", "transformers"])
def test_an_llm_alive_at_interpreter_exit_stops_quietly(backend):
    """Its finalizer runs after Python has closed its thread pools: no traceback, no
    warning, exit status 0."""
    script = (
        "from llmctl import LLM, SamplingParams\n"
        f"llm = LLM('demo', backend={backend!r}, device='cpu', dtype='float32')\n"
        "print(len(llm.generate('a b', SamplingParams(max_tokens=2))[0].token_ids))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"
    assert "Traceback" not in done.stderr and "WARNING" not in done.stderr, done.stderr


def test_n_choices_per_prompt_each_as_its_own_seeded_request(llm):
    sampling = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6)
    results = llm.generate(["a b", "c d e"], sampling)
    assert [len(r.outputs) for r in results] == [3, 3]
    for prompt, result in zip(["a b", "c d e"], results):
        assert [c.index for c in result.outputs] == [0, 1, 2]
        # choice j is exactly the single request seeded seed + j
        for j, choice in enumerate(result.outputs):
            alone = llm.generate(prompt, SamplingParams(seed=11 + j, max_tokens=6))[0]
            assert choice.token_ids == alone.token_ids and choice.text == alone.text
            assert choice.finish_reason == alone.finish_reason
        assert result.text == result.outputs[0].text  # the first choice, as with n=1
    greedy = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(n=2, temperature=0))
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids


@pytest.mark.parametrize("n", [0, -1])
def test_n_below_one_is_refused(n):
    with pytest.raises(InvalidRequest, match="n must be at least 1"):
        SamplingParams(n=n)
