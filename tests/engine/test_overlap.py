"""Overlapped steps (the GPU's async scheduling), driven on the CPU with the toy model.

With ``overlap=True`` a step is prepared while the one before is still "running": its
decode tokens are placeholders the runner fills from the previous step's sampled ids
on the device, finished requests are found one step late, and their extra token is
dropped. On the CPU nothing runs behind the host's back, but the bookkeeping is the
same, so every token must equal the sequential engine's.
"""

from __future__ import annotations

import pytest
import torch

from llmctl.engine.sampling_params import SamplingParams
from llmctl.model.token_bytes import token_pieces
from tests.helpers.paged_toy_model import PagedToyModel, make_engine, run, workload


@pytest.fixture(scope="module")
def sequential(stories_tokenizer):
    return run(make_engine(stories_tokenizer), workload())


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_overlapped_steps_give_the_tokens_of_sequential_ones(
    stories_tokenizer, sequential, prefix_caching, block_size
) -> None:
    engine = make_engine(
        stories_tokenizer,
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        overlap=True,
    )
    assert run(engine, workload()) == sequential
    # Decode steps took their input tokens from the device, not from the host.
    assert engine.runner.tokens_read_on_device > 50


def test_overlap_with_chunked_prefill_and_preemption(stories_tokenizer, sequential) -> None:
    chunked = make_engine(stories_tokenizer, max_num_batched_tokens=7, max_num_seqs=3, overlap=True)
    assert run(chunked, workload()) == sequential
    tiny = make_engine(stories_tokenizer, num_blocks=16, max_model_len=64, overlap=True)
    assert run(tiny, workload()) == sequential
    assert tiny.scheduler.num_preemptions > 0


def test_overlap_stops_on_eos_stop_ids_and_stop_strings(stories_tokenizer) -> None:
    prompt = list(range(3, 15))
    free_run, _ = run(make_engine(stories_tokenizer), [("a", prompt, SamplingParams(20, 0))])["a"]
    token = next(t for i, t in enumerate(free_run) if free_run.index(t) == i and i >= 3)
    cases = [
        ({}, {"stop_token_ids": [token]}),
        ({"eos_token_ids": (token,)}, {}),
        ({"eos_token_ids": (token,)}, {"min_tokens": free_run.index(token) + 2}),
        ({}, {"max_tokens": 5}),
    ]
    for config, params in cases:
        params = SamplingParams(**{"max_tokens": 20, "temperature": 0, **params})
        expected = run(make_engine(stories_tokenizer, **config), [("a", prompt, params)])
        overlapped = make_engine(stories_tokenizer, overlap=True, **config)
        assert run(overlapped, [("a", prompt, params)]) == expected


def test_overlap_waits_for_the_host_when_a_request_has_penalties(stories_tokenizer) -> None:
    work = [
        ("plain", list(range(3, 20)), SamplingParams(16, temperature=0)),
        ("penalized", list(range(5, 30)), SamplingParams(16, temperature=0, presence_penalty=1.5)),
    ]
    expected = run(make_engine(stories_tokenizer), work)
    engine = make_engine(stories_tokenizer, overlap=True)
    assert run(engine, work) == expected


class ScriptedModel(PagedToyModel):
    """Writes the cache like the toy model, then makes each sequence say its script:
    the logits of a sequence whose first prompt token is ``t`` put the next token of
    ``scripts[t]`` first."""

    def __init__(self, scripts: dict[int, tuple[int, list[int]]], vocab_size: int) -> None:
        super().__init__(num_blocks=256, block_size=4, vocab_size=vocab_size)
        self.scripts = scripts  # first prompt token -> (prompt length, output tokens)

    def execute(self, batch):
        super().execute(batch)
        rows = []
        for table, length in zip(batch.block_tables, batch.context_lens):
            first_token = int(self.token_cache[int(table[0]) * self.block_size])
            prompt_len, script = self.scripts[first_token]
            logits = torch.zeros(self.unembed.shape[1])
            logits[script[min(int(length) - prompt_len, len(script) - 1)]] = 10.0
            rows.append(logits)
        return torch.stack(rows)


def test_multibyte_text_and_stop_strings_are_right_under_batching(stories_tokenizer) -> None:
    """Texts whose characters stories260K spells one byte token at a time (é, 世, 🙂),
    stop strings inside and across them, all requests in one batch, overlapped or
    not: each request's text is its script's, cut exactly before its stop string."""
    texts = ["Once upon 世界 a time", "🙂 dogs and 🙂 cats", "café naïve résumé", "a€b€c€d"]
    stops = [["界 a"], ["and 🙂"], ["ve ré"], []]
    scripts, requests, expected = {}, [], {}
    for i, (text, stop) in enumerate(zip(texts, stops)):
        prompt = [400 + i, 300, 301]  # a first token to tell the scripts apart
        output = stories_tokenizer.encode(text, add_special_tokens=False)
        scripts[prompt[0]] = (len(prompt), output)
        requests.append((f"r{i}", prompt, SamplingParams(len(output), 0, stop=stop)))
        whole = stories_tokenizer.decode(prompt + output)[len(stories_tokenizer.decode(prompt)) :]
        assert not stop or stop[0] in whole
        expected[f"r{i}"] = whole[: whole.find(stop[0])] if stop else whole
    for overlap in (False, True):
        engine = make_engine(stories_tokenizer, vocab_size=512, overlap=overlap)
        engine.runner = ScriptedModel(scripts, vocab_size=512)
        for request in requests:
            engine.add_request(*request)
        got = {request_id: "" for request_id, _, _ in requests}
        while engine.has_unfinished():
            for output in engine.step():
                assert "\ufffd" not in output.text
                got[output.request_id] += output.text
        assert got == expected
        assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_abort_with_a_token_in_flight_frees_every_block(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, num_blocks=64, overlap=True)
    for request_id, prompt, params in workload():
        engine.add_request(request_id, prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    for request_id, _, _ in workload():
        engine.abort(request_id)
    assert engine.step() == []  # the step in flight belongs to aborted requests only
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_overlapped_steps_on_the_gpu_give_the_tokens_of_sequential_ones(
    stories_tokenizer,
) -> None:
    """stories260K on the torch backend's CUDA path: steps overlap by default there, and
    greedy and seeded tokens equal those of steps run one after the other."""
    from llmctl_torch.model import TorchModelRunner

    from llmctl.engine.config import EngineConfig
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.model.config import ModelConfig
    from tests.conftest import STORIES

    config = ModelConfig.from_dir(STORIES)
    results, read_on_device = {}, {}
    for overlap in (None, False):  # None: the default, which overlaps on CUDA
        runner = TorchModelRunner(STORIES, config, device="cuda", block_size=16, num_blocks=64)
        engine = LLMEngine(
            runner,
            stories_tokenizer,
            EngineConfig(block_size=16, device="cuda"),
            max_model_len=256,
            vocab_size=config.vocab_size,
            overlap=overlap,
        )
        batches = []

        def recording(batch, batches=batches, execute=runner.execute):
            batches.append(batch.sampled_tokens)
            return execute(batch)

        runner.execute = recording
        results[overlap] = run(engine, workload())
        read_on_device[overlap] = sum(fill is not None for fill in batches)
    assert results[None] == results[False]
    assert read_on_device[None] > 10 and read_on_device[False] == 0


@pytest.mark.parametrize("skip_special", [True, False])
def test_plain_rows_texts_equal_the_tokenizers_decode(stories_tokenizer, skip_special) -> None:
    """Requests without stop strings take the engine's inline path (a token's text from
    the byte table): random outputs with special tokens, byte tokens of split characters
    and a stop id, with and without its text, give the tokenizer's own decode."""
    generator = torch.Generator().manual_seed(32)
    special = stories_tokenizer.hf_tokenizer.get_added_tokens_decoder()
    special_ids = sorted(i for i, token in special.items() if token.special) or [0]
    # Whole characters: tokens that are valid UTF-8 alone, and byte tokens that spell one.
    whole = [t for t, text in enumerate(token_pieces(stories_tokenizer).texts) if text]
    emoji = stories_tokenizer.encode("🙂é", add_special_tokens=False)
    scripts, requests, expected = {}, [], {}
    for i in range(6):
        picks = torch.randint(0, len(whole), (12,), generator=generator).tolist()
        body = [whole[pick] for pick in picks]
        output = body[:4] + emoji + [special_ids[i % len(special_ids)]] + body[4:]
        stop_id = output[-3]
        include = bool(i % 2)
        prompt = [400 + i, 300, 301]
        scripts[prompt[0]] = (len(prompt), output)
        params = SamplingParams(
            len(output),
            0,
            stop_token_ids=[stop_id],
            include_stop_str_in_output=include,
            skip_special_tokens=skip_special,
        )
        requests.append((f"r{i}", prompt, params))
        kept = output[: output.index(stop_id) + (1 if include else 0)]
        full = stories_tokenizer.decode(prompt + kept, skip_special)
        expected[f"r{i}"] = full[len(stories_tokenizer.decode(prompt, skip_special)) :]
    for overlap in (False, True):
        engine = make_engine(stories_tokenizer, vocab_size=512, overlap=overlap)
        engine.runner = ScriptedModel(scripts, vocab_size=512)
        for request in requests:
            engine.add_request(*request)
        got = {request_id: "" for request_id, _, _ in requests}
        while engine.has_unfinished():
            for output in engine.step():
                got[output.request_id] += output.text
        assert got == expected
