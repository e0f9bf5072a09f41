"""The Python API's edges: empty inputs return at once, an LLM is a context manager, and
one dropped without ``shutdown()`` still stops its engine."""

from __future__ import annotations

import gc
import threading

import pytest

from llmctl import LLM, SamplingParams


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
