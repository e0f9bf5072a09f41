"""The transformers backend's engine in-process, on tiny random non-Llama models the tests
make themselves: greedy tokens equal transformers' own ``generate``, many requests in
flight at once, aborts free their pages, and what transformers cannot honour is a 400."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest

from llmctl.backend import GenerationOutput, GenerationRequest, SamplingParams
from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.sampling_params import StructuredOutput
from llmctl.errors import InvalidRequest
from tests.helpers.tiny_models import hf_greedy, load_hf_model
from tests.plugins.conftest import require_transformers_plugin

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Small pages and a small token budget per batch, so prompts span several pages and
# long prompts are prefilled in chunks beside other requests' decodes.
SMALL = {
    "backend": "transformers",
    "cache_block_seq_len": 16,
    "max_prefill_token_num": 32,
    "max_batch_size": 4,
    "cache_max_entry_count": "96",
}
NEW_TOKENS = 12


def open_transformers_engine(model_dir, **flags: Any):
    from llmctl.selection import select

    require_transformers_plugin()
    choice = select(str(model_dir), {**SMALL, **flags}, env={})
    assert choice.backend.name == "transformers"
    return choice.create_engine()


@pytest.fixture(scope="module", params=["gpt2", "phi"])
def engine_and_model(request, tiny_non_llama) -> Iterator[tuple[Any, Any]]:
    model_dir = tiny_non_llama(request.param)
    engine = open_transformers_engine(model_dir)
    yield engine, model_dir
    asyncio.run(engine.shutdown())


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


async def collect(engine, request_id: str, prompt: list[int], **sampling) -> list[GenerationOutput]:
    request = GenerationRequest(
        request_id, prompt_token_ids=prompt, sampling=SamplingParams(**sampling)
    )
    return [output async for output in engine.generate(request)]


def detokenized(engine, prompt: list[int], token_ids: list[int]) -> str:
    """What llmctl's incremental detokenizer makes of ``token_ids`` after ``prompt``."""
    detokenizer = IncrementalDetokenizer(engine.tokenizer, prompt, SamplingParams())
    for token in token_ids:
        detokenizer.add_token(token)
    return detokenizer.take_new_text(final=True)


def tokens(outputs: list[GenerationOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


def test_greedy_tokens_equal_transformers_generate_with_many_requests_in_flight(
    engine_and_model,
) -> None:
    engine, model_dir = engine_and_model
    # Lengths from 1 to 70 tokens (up to 5 pages, up to 3 prefill chunks); the last two
    # prompts share their first 40 tokens, so transformers may share those pages.
    prompts = random_prompts([1, 5, 16, 17, 33, 70, 9, 40])
    prompts.append(prompts[-1][:40] + random_prompts([20], seed=1)[0])
    expected = hf_greedy(load_hf_model(model_dir), prompts, NEW_TOKENS)
    running_seen: list[int] = []

    async def one(i: int, prompt: list[int]) -> list[int]:
        request = GenerationRequest(
            f"greedy-{i}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0),
        )
        out = []
        async for output in engine.generate(request):
            running_seen.append(engine.stats().running)
            out += output.token_ids
        return out

    async def all_at_once() -> list[list[int]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(all_at_once()) == expected
    # 9 requests were in flight together, batched at most max_batch_size at a time.
    assert 1 < max(running_seen) <= SMALL["max_batch_size"]
    assert engine.stats().running == 0


def test_outputs_stream_one_token_at_a_time_with_counts(engine_and_model) -> None:
    engine, _ = engine_and_model
    prompt = random_prompts([10], seed=2)[0]
    outputs = asyncio.run(collect(engine, "counts", prompt, max_tokens=6, temperature=0))
    assert [len(o.token_ids) for o in outputs] == [1] * 6
    assert [o.completion_tokens for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert all(o.prompt_tokens == 10 for o in outputs)
    assert outputs[0].prompt_token_ids == prompt and outputs[1].prompt_token_ids is None
    assert [o.finished for o in outputs] == [False] * 5 + [True]
    assert outputs[-1].finish_reason == "length"
    # The text is llmctl's incremental detokenization of those tokens, as on every backend.
    assert "".join(o.text for o in outputs) == detokenized(engine, prompt, tokens(outputs))


def test_stop_token_and_stop_string_end_the_request(engine_and_model) -> None:
    engine, _ = engine_and_model
    prompt = random_prompts([12], seed=3)[0]
    free = tokens(asyncio.run(collect(engine, "free", prompt, max_tokens=8, temperature=0)))
    # A stop token ends the request on it, without its text.
    stopped = asyncio.run(
        collect(engine, "stop-id", prompt, max_tokens=8, temperature=0, stop_token_ids=[free[3]])
    )
    assert tokens(stopped) == free[: free.index(free[3]) + 1]
    assert stopped[-1].finish_reason == "stop"
    # A stop string (the text of tokens 3-4) cuts the text just before it.
    full_text = detokenized(engine, prompt, free)
    stop = detokenized(engine, prompt, free[:5])[len(detokenized(engine, prompt, free[:3])) :]
    if not stop.strip():
        pytest.skip("this model's tokens 3-4 decode to no usable stop string")
    cut = asyncio.run(collect(engine, "stop-str", prompt, max_tokens=8, temperature=0, stop=[stop]))
    assert cut[-1].finish_reason == "stop"
    assert "".join(o.text for o in cut) == full_text[: full_text.index(stop)]
    assert asyncio.run(blocks_once_settled(engine)) == 0  # transformers stopped it too


def test_abort_frees_the_requests_pages(engine_and_model) -> None:
    engine, _ = engine_and_model
    prompt = random_prompts([50], seed=4)[0]

    async def run() -> tuple[int, list[GenerationOutput], int]:
        request = GenerationRequest(
            "to-abort",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=150, temperature=0, ignore_eos=True),
        )
        outputs = []
        used_while_running = 0
        async for output in engine.generate(request):
            outputs.append(output)
            if len(outputs) == 2:
                used_while_running = engine.stats().kv_blocks_used
                await engine.abort("to-abort")
        return used_while_running, outputs, await blocks_once_settled(engine)

    used_while_running, outputs, used_after = asyncio.run(run())
    assert used_while_running >= 4  # 52 tokens in pages of 16
    last = outputs[-1]
    assert last.finished and last.finish_reason == "abort" and not last.token_ids
    # Tokens already on their way when the abort came are delivered and counted; far
    # fewer than the 150 asked for.
    assert last.completion_tokens == len(tokens(outputs)) < 150
    assert used_after == 0


def test_leaving_the_stream_early_aborts_the_request(engine_and_model) -> None:
    engine, _ = engine_and_model
    prompt = random_prompts([30], seed=5)[0]

    async def run() -> int:
        request = GenerationRequest(
            "left",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=150, temperature=0, ignore_eos=True),
        )
        stream = engine.generate(request)
        async for _ in stream:
            break
        await stream.aclose()
        return await blocks_once_settled(engine)

    assert asyncio.run(run()) == 0


async def blocks_once_settled(engine, rounds: int = 300) -> int:
    """KV blocks in use once transformers has applied pending cancellations (it does at
    its next loop turn, within 0.1 s when idle): polled, at most ``rounds`` times."""
    for _ in range(rounds):
        stats = engine.stats()
        if stats.running == 0 and stats.kv_blocks_used == 0:
            return 0
        await asyncio.sleep(0.05)
    return engine.stats().kv_blocks_used


@pytest.mark.parametrize(
    "sampling, named",
    [
        ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
        ({"min_p": 0.1}, "min_p=0.1"),
        ({"min_tokens": 2}, "min_tokens=2"),
        ({"seed": 7}, "seed=7"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs=True"),
        ({"logit_bias": {5: 3.0}}, "logit_bias="),
        ({"prompt_logprobs": 1}, "prompt_logprobs=1"),
        ({"structured": StructuredOutput("regex", "[0-9]+")}, "structured output"),
    ],
)
def test_what_transformers_cannot_honour_is_refused_before_any_output(
    engine_and_model, sampling: dict, named: str
) -> None:
    engine, _ = engine_and_model
    with pytest.raises(InvalidRequest, match=named):
        asyncio.run(collect(engine, "refused", [5, 6, 7], max_tokens=4, **sampling))
    assert engine.stats().running == 0


def test_requests_that_cannot_fit_are_refused(engine_and_model) -> None:
    engine, _ = engine_and_model
    with pytest.raises(InvalidRequest, match="session_len 256"):
        asyncio.run(collect(engine, "long", [5] * 250, max_tokens=10))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        asyncio.run(collect(engine, "vocab", [5, 9999], max_tokens=2))


def test_sampling_is_seeded_by_the_engine_and_honours_top_k(engine_and_model) -> None:
    engine, _ = engine_and_model
    prompt = random_prompts([8], seed=6)[0]
    # top_k=1 at any temperature is greedy.
    greedy = tokens(asyncio.run(collect(engine, "g", prompt, max_tokens=8, temperature=0)))
    top1 = tokens(
        asyncio.run(collect(engine, "k1", prompt, max_tokens=8, temperature=1.5, top_k=1))
    )
    assert top1 == greedy
    sampled = tokens(asyncio.run(collect(engine, "t", prompt, max_tokens=8, temperature=1.0)))
    assert len(sampled) == 8 and all(0 <= t < 512 for t in sampled)


def test_shutdown_ends_requests_in_flight(tiny_non_llama) -> None:
    engine = open_transformers_engine(tiny_non_llama("gpt2"))

    async def run() -> GenerationOutput:
        request = GenerationRequest(
            "in-flight",
            prompt_token_ids=[5, 6, 7],
            sampling=SamplingParams(max_tokens=250, temperature=0, ignore_eos=True),
        )
        stream = engine.generate(request)
        first = await anext(stream)
        assert not first.finished
        await engine.shutdown()
        return [output async for output in stream][-1]

    last = asyncio.run(run())
    assert last.finish_reason == "abort" and last.completion_tokens < 250
    assert not engine.is_alive()


def test_an_architecture_transformers_cannot_batch_is_served_by_plain_generate(
    tiny_non_llama,
) -> None:
    """GPT-NeoX's transformers code cannot run continuous batching (transformers 5.24):
    the one-token probe at engine start finds it, and the engine serves the model through
    plain ``generate`` with dynamic batches, giving transformers' own greedy tokens for
    requests of different lengths in flight together; an abort ends only its request."""
    model_dir = tiny_non_llama("gpt_neox")
    engine = open_transformers_engine(model_dir)
    check_plain_generate(engine, model_dir)


def test_plain_generate_serves_any_model_with_dynamic_batches(tiny_non_llama) -> None:
    """The same path, built directly on a model continuous batching runs too (gpt2), so
    it is tested whatever the installed transformers can batch."""
    import transformers
    from llmctl_transformers.plain_generate import PlainGenerateEngine

    from llmctl.model.tokenizer import Tokenizer

    model_dir = tiny_non_llama("gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine = PlainGenerateEngine(
        model,
        Tokenizer.from_dir(model_dir),
        model_name="gpt2",
        max_model_len=256,
        vocab_size=512,
        max_batch=8,
        seed=0,
    )
    check_plain_generate(engine, model_dir)


def check_plain_generate(engine, model_dir) -> None:
    prompts = random_prompts([3, 20, 9, 14], seed=random.randrange(1 << 20))
    lengths = [8, 5, 12, 1]

    async def run() -> tuple[list[list[int]], GenerationOutput]:
        async def one(i: int) -> list[int]:
            outs = await collect(
                engine, f"neox-{i}", prompts[i], max_tokens=lengths[i], temperature=0
            )
            return tokens(outs)

        async def aborted() -> GenerationOutput:
            request = GenerationRequest(
                "neox-abort",
                prompt_token_ids=prompts[0],
                sampling=SamplingParams(max_tokens=200, temperature=0),
            )
            stream = engine.generate(request)
            await anext(stream)
            await engine.abort("neox-abort")
            return [output async for output in stream][-1]

        *got, last = await asyncio.gather(*(one(i) for i in range(len(prompts))), aborted())
        return got, last

    try:
        got, last = asyncio.run(run())
    finally:
        asyncio.run(engine.shutdown())
    model = load_hf_model(model_dir)
    assert got == [hf_greedy(model, [p], n)[0] for p, n in zip(prompts, lengths)]
    assert last.finish_reason == "abort" and last.completion_tokens < 200
