"""AsyncEngine: concurrent streams, refusal before output, abort on disconnect, any loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmctl.backend import Engine, GenerationRequest
from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.step_profile import StepProfile
from llmctl.errors import InvalidRequest
from tests.helpers.paged_toy_model import make_engine, run, workload


@pytest.fixture
def engine(stories_tokenizer):
    engine = AsyncEngine(make_engine(stories_tokenizer, num_blocks=48), model_name="toy")
    yield engine
    asyncio.run(engine.shutdown())


async def collect(engine: AsyncEngine, request: GenerationRequest):
    tokens, outputs = [], []
    async for out in engine.generate(request):
        tokens += out.token_ids
        outputs.append(out)
    return tokens, outputs


def requests_of(work):
    return [GenerationRequest(rid, prompt_token_ids=p, sampling=s) for rid, p, s in work]


def wait_until_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == stats.waiting == stats.kv_blocks_used == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_is_an_engine(engine) -> None:
    assert isinstance(engine, Engine)
    assert engine.max_model_len == 128 and engine.model_name == "toy"


def test_concurrent_requests_stream_the_same_tokens_as_the_sync_engine(
    engine, stories_tokenizer
) -> None:
    expected = run(make_engine(stories_tokenizer), workload())

    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests_of(workload())))

    results = asyncio.run(main())
    for (request_id, _, _), (tokens, outputs) in zip(workload(), results):
        assert (tokens, outputs[-1].finish_reason) == expected[request_id]
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].completion_tokens == len(tokens)
        assert outputs[0].prompt_token_ids is not None
    wait_until_idle(engine)


def test_refused_request_raises_before_any_output(engine) -> None:
    async def main():
        stream = engine.generate(
            GenerationRequest("long", prompt_token_ids=[3] * 100, sampling=SamplingParams(50))
        )
        with pytest.raises(InvalidRequest, match="session_len 128"):
            await stream.__anext__()

    asyncio.run(main())


def test_text_prompt_is_tokenized(stories_tokenizer) -> None:
    engine = AsyncEngine(make_engine(stories_tokenizer, vocab_size=512), model_name="toy")
    request = GenerationRequest("t", prompt="Once upon", sampling=SamplingParams(3, 0))
    _, outputs = asyncio.run(collect(engine, request))
    asyncio.run(engine.shutdown())
    assert outputs[0].prompt_token_ids == stories_tokenizer.encode("Once upon")


def test_consumer_leaving_early_aborts_and_frees_blocks(engine) -> None:
    async def main():
        request = GenerationRequest("r", prompt_token_ids=[5] * 30, sampling=SamplingParams(60))
        stream = engine.generate(request)
        await stream.__anext__()
        await stream.aclose()  # what a disconnected HTTP client does

    asyncio.run(main())
    wait_until_idle(engine)


def test_cancelled_task_aborts_its_request(engine) -> None:
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(
                GenerationRequest("r", prompt_token_ids=[5] * 30, sampling=SamplingParams(90))
            ):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until_idle(engine)


def test_abort_ends_the_stream_with_abort(engine) -> None:
    async def main():
        request = GenerationRequest("r", prompt_token_ids=[5] * 30, sampling=SamplingParams(90))
        outputs = []
        async for out in engine.generate(request):
            outputs.append(out)
            if len(outputs) == 2:
                await engine.abort("r")
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finish_reason == "abort" and len(outputs) < 90
    wait_until_idle(engine)


def test_duplicate_request_id_is_refused(engine) -> None:
    async def main():
        request = GenerationRequest("same", prompt_token_ids=[5] * 3, sampling=SamplingParams(40))
        first = engine.generate(request)
        await first.__anext__()
        with pytest.raises(InvalidRequest, match="already in use"):
            await engine.generate(request).__anext__()
        await first.aclose()

    asyncio.run(main())


def test_usable_from_several_event_loops_at_once(engine, stories_tokenizer) -> None:
    expected = run(make_engine(stories_tokenizer), workload())
    results = {}

    def client(work):
        async def main():
            return await asyncio.gather(*(collect(engine, r) for r in requests_of(work)))

        for (request_id, _, _), (tokens, outputs) in zip(work, asyncio.run(main())):
            results[request_id] = (tokens, outputs[-1].finish_reason)

    threads = [threading.Thread(target=client, args=(workload()[i::3],)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected


def test_a_failing_step_fails_its_requests_and_the_engine_survives(engine, monkeypatch) -> None:
    runner = engine.engine.runner
    real_execute = runner.execute
    failures = iter([True])

    def flaky(batch):
        if next(failures, False):
            raise RuntimeError("device lost")
        return real_execute(batch)

    monkeypatch.setattr(runner, "execute", flaky)
    request = GenerationRequest("a", prompt_token_ids=[5] * 8, sampling=SamplingParams(4))
    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(collect(engine, request))
    tokens, _ = asyncio.run(collect(engine, request))
    assert len(tokens) == 4
    wait_until_idle(engine)


def test_shutdown_aborts_requests_in_flight(stories_tokenizer) -> None:
    engine = AsyncEngine(make_engine(stories_tokenizer), model_name="toy")

    async def main():
        request = GenerationRequest("r", prompt_token_ids=[5] * 8, sampling=SamplingParams(100))
        outputs = []
        async for out in engine.generate(request):
            outputs.append(out)
            if len(outputs) == 1:
                await engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(collect(engine, GenerationRequest("x", prompt_token_ids=[3])))


def test_outputs_reach_an_event_loop_once_per_step(engine, stories_tokenizer) -> None:
    """Ten requests streaming in one event loop: the engine thread calls into the loop
    once per step that has outputs, not once per output."""
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: calls.append(args) or real(*args)
        return await asyncio.gather(*(collect(engine, r) for r in requests_of(workload())))

    engine.engine.profile = StepProfile()
    results = asyncio.run(main())
    outputs = sum(len(outs) for _, outs in results)
    steps = engine.engine.profile.steps
    assert outputs > 3 * steps  # several requests got a token in most steps
    assert len(calls) <= steps
    expected = run(make_engine(stories_tokenizer), workload())
    assert {r: (t, o[-1].finish_reason) for (r, _, _), (t, o) in zip(workload(), results)} == (
        expected
    )


def test_generate_all_returns_each_requests_outputs(engine, stories_tokenizer) -> None:
    expected = run(make_engine(stories_tokenizer), workload())
    seen = []
    results = engine.generate_all(requests_of(workload()), on_outputs=seen.append)
    for (request_id, prompt, _), result in zip(workload(), results):
        assert result.request_id == request_id and result.prompt_token_ids == prompt
        assert (result.token_ids, result.finish_reason) == expected[request_id]
        assert result.finished and result.completion_tokens == len(result.token_ids)
        steps = [o for batch in seen for o in batch if o.request_id == request_id]
        assert len(steps) == len(result.token_ids)  # one output per token, per step
        assert result.text == "".join(o.text for o in steps)
    assert len(seen) <= engine.engine.profile.steps
    wait_until_idle(engine)


def test_generate_all_refuses_before_anything_runs(engine) -> None:
    good = GenerationRequest("ok", prompt_token_ids=[5] * 4, sampling=SamplingParams(4))
    too_long = GenerationRequest("long", prompt_token_ids=[3] * 100, sampling=SamplingParams(50))
    with pytest.raises(InvalidRequest, match="session_len 128"):
        engine.generate_all([good, too_long])
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.generate_all([good, good])
    assert engine.stats().waiting == 0 and engine.stats().running == 0
    assert len(engine.generate_all([good])[0].token_ids) == 4


def test_generate_all_fails_on_a_failing_step_and_frees_blocks(engine, monkeypatch) -> None:
    runner = engine.engine.runner
    real_execute = runner.execute
    calls = iter(range(1000))

    def flaky(batch):
        if next(calls) == 3:
            raise RuntimeError("device lost")
        return real_execute(batch)

    monkeypatch.setattr(runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate_all(requests_of(workload()))
    wait_until_idle(engine)
    assert len(engine.generate_all(requests_of(workload()[:2]))) == 2


def test_a_running_engine_keeps_its_startup_heap_out_of_full_collections(
    stories_tokenizer,
) -> None:
    """The heap alive at start is frozen (``freeze_heap``): a full collection walks only
    what came after, and a ``generate_all`` call leaves no garbage in cycles behind it
    (its collector referred to itself). Shutting down unfreezes the heap."""
    import gc

    engine = AsyncEngine(make_engine(stories_tokenizer, num_blocks=48), model_name="toy")
    try:
        assert gc.get_freeze_count() > 1000
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds goes to gc.garbage
        try:
            requests = requests_of(workload())
            outputs = engine.generate_all(requests)
            assert len(outputs) == len(requests)
            del outputs
            gc.collect()
            assert gc.garbage == []
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    finally:
        asyncio.run(engine.shutdown())
    assert gc.get_freeze_count() == 0
