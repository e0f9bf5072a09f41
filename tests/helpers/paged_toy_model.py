"""A small deterministic model over a real paged cache, for engine tests without weights.

It implements ``ModelRunner`` honestly: each step writes the new tokens into cache
slots, then reads every sequence's whole context back through its block table. The
logits at a position are a fixed random function of all tokens before it (order
included), so a wrong block table, an overwritten shared block or a stale slot
changes the generated tokens. Each slot also records the position written there, and
reading a slot whose position does not match fails loudly.

``make_engine`` puts the shared engine around it; ``workload`` and ``run`` drive it (the
scheduler, overlap and async-engine tests share them).
"""

from __future__ import annotations

import random

import torch

from llmctl.engine.config import EngineConfig
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.runner import StepBatch
from llmctl.engine.sampling_params import SamplingParams


class PagedToyModel:
    tensor_parallel_size = 1
    serves_lora = False

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 64, seed: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device("cpu")
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab_size, 32, generator=generator)
        self.position_mix = torch.randn(4096, 32, generator=generator)
        self.unembed = torch.randn(32, vocab_size, generator=generator) * 3
        self.token_cache = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.position_cache = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.steps = 0
        self.tokens_read_on_device = 0  # input tokens an overlapped step left to the runner

    def close(self) -> None:
        self.closed = True

    def execute(self, batch: StepBatch) -> torch.Tensor:
        self.steps += 1
        slots = torch.tensor(batch.slot_mapping, dtype=torch.long)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long)
        batch.fill_sampled_tokens(input_ids)
        if batch.sampled_tokens is not None:
            self.tokens_read_on_device += len(batch.sampled_tokens.token_ids)
        assert (input_ids >= 0).all(), "an input token was left a placeholder"
        self.token_cache[slots] = input_ids
        self.position_cache[slots] = torch.tensor(batch.positions, dtype=torch.long)
        # The tokens whose logits are returned: each sequence's last, or the step's own
        # list (speculative steps verify several positions of a sequence).
        ends = torch.tensor(batch.query_lens).cumsum(0)
        wanted = ends - 1 if batch.logits_indices is None else torch.tensor(batch.logits_indices)
        owner = torch.searchsorted(ends, wanted, right=True).tolist()
        token_positions = torch.tensor(batch.positions)[wanted].tolist()
        rows = []
        for seq, position in zip(owner, token_positions):
            table, length = batch.block_tables[seq], int(batch.context_lens[seq])
            assert position < length
            positions = torch.arange(position + 1)  # the context up to that token
            blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
            context_slots = blocks * self.block_size + positions % self.block_size
            assert torch.equal(self.position_cache[context_slots], positions), "stale KV slot"
            tokens = self.token_cache[context_slots]
            hidden = torch.tanh((self.embed[tokens] * self.position_mix[positions]).sum(0))
            rows.append(hidden @ self.unembed)
        return torch.stack(rows)


VOCAB = 64


class RecordingModel(PagedToyModel):
    """Also records the shape of every step it runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.query_lens: list[list[int]] = []

    def execute(self, batch):
        self.query_lens.append(list(batch.query_lens))
        return super().execute(batch)


def make_engine(
    tokenizer,
    *,
    num_blocks=256,
    block_size=4,
    max_model_len=128,
    vocab_size=VOCAB,
    eos_token_ids=(),
    overlap=False,
    **options,
):
    model = RecordingModel(num_blocks, block_size, vocab_size)
    return LLMEngine(
        model,
        tokenizer,
        EngineConfig(block_size=block_size, **options),
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
        overlap=overlap,
    )


def workload(seed: int = 0, count: int = 10):
    """Prompts of varied lengths, half sharing a 12-token prefix; greedy and seeded."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]
    requests = []
    for i in range(count):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))]
        prompt = (shared + own) if i % 2 else own
        params = (
            SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0)
            if i % 3
            else SamplingParams(max_tokens=rng.randrange(4, 24), temperature=1.0, seed=i)
        )
        requests.append((f"r{i}", prompt, params))
    return requests


def run(engine: LLMEngine, requests) -> dict[str, tuple[list[int], str | None]]:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    results = {request_id: ([], None) for request_id, _, _ in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.token_ids, out.finish_reason)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)
    return results
