"""The torch backend's runner with the Triton kernels gives transformers' greedy tokens.

``LLMCTL_TORCH_ATTENTION=triton`` makes the runner use the Triton kernels even on CPU,
where they run through the Triton interpreter (on a GPU, the runner runs on CUDA). The expected tokens are transformers'
greedy continuations of stories260K stored in its ``reference_greedy.json``. Prompts
are batched, one is prefilled in two chunks (so the prefill kernel reads a cached
prefix), and the blocks are physically shuffled.

The interpreter runs one kernel program at a time (about 50 ms each), so the default
test decodes a few tokens of two prompts; the slow one decodes all of them.
"""

from __future__ import annotations

import json

import pytest
import torch
from llmctl_torch import triton_attention  # noqa: F401  (switches the interpreter on early)
from llmctl_torch.model import TorchModelRunner

from llmctl.model.config import ModelConfig
from tests.helpers.tiny_models import PagedSequences

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_cases(model_dir) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, greedy new_token_ids)`` pairs computed by transformers."""
    reference = json.loads((model_dir / "reference_greedy.json").read_text())
    cases = [(r["prompt_ids"], r["new_token_ids"]) for r in reference["results"]]
    bos = json.loads((model_dir / "config.json").read_text())["bos_token_id"]
    return [([bos], reference["from_bos_only"]["new_token_ids"]), *cases]


def greedy_with_triton(
    monkeypatch: pytest.MonkeyPatch, model_dir, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Batched greedy decoding through the runner with the Triton kernels; the last
    prompt is prefilled in two chunks."""
    monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", "triton")
    config = ModelConfig.from_dir(model_dir)
    runner = TorchModelRunner(model_dir, config, device=DEVICE, block_size=16, num_blocks=40)
    assert runner.ops.name == "triton"
    paged = PagedSequences(runner, seed=3)
    seqs = [paged.add(p) for p in prompts]
    chunked = seqs[-1]
    first_chunk = len(prompts[chunked]) // 2
    if first_chunk:
        paged.step({chunked: first_chunk})
    counts = {s: len(prompts[s]) - paged.cached[s] for s in seqs}
    for _ in range(new_tokens):
        logits = paged.step(counts)
        for row, seq in enumerate(counts):
            paged.tokens[seq].append(int(logits[row].argmax()))
        counts = {s: 1 for s in seqs}
    return [paged.tokens[s][len(prompts[s]) :] for s in seqs]


def test_triton_greedy_tokens_match_transformers(monkeypatch, stories_dir):
    cases = reference_cases(stories_dir)[:2]  # the BOS-only prompt and a 5-token one
    got = greedy_with_triton(monkeypatch, stories_dir, [p for p, _ in cases], new_tokens=6)
    assert got == [want[:6] for _, want in cases]


@pytest.mark.slow
def test_triton_greedy_tokens_match_transformers_on_every_prompt(monkeypatch, stories_dir):
    cases = reference_cases(stories_dir)
    new_tokens = len(cases[0][1])
    got = greedy_with_triton(monkeypatch, stories_dir, [p for p, _ in cases], new_tokens)
    assert got == [want for _, want in cases]


def test_triton_int8_cache_gives_the_plain_torch_paths_logits(monkeypatch, stories_dir):
    """Both paths quantize each token's K/V the same way (up to a code at an exact
    rounding boundary) and dequantize on load; their logits agree to float32 rounding."""
    config = ModelConfig.from_dir(stories_dir)
    prompts = [p for p, _ in reference_cases(stories_dir)[:2]]
    logits = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv("LLMCTL_TORCH_ATTENTION", path)
        runner = TorchModelRunner(
            stories_dir, config, device=DEVICE, block_size=16, num_blocks=8,
            kv_cache_dtype="int8", quantization="int8",
        )  # fmt: skip
        assert runner.ops.name == path and runner.kv_caches[0].k.dtype == torch.int8
        paged = PagedSequences(runner, seed=1)
        seqs = [paged.add(p + [300, 301, 302]) for p in prompts]
        steps = [paged.step({s: len(prompts[s]) for s in seqs})]
        steps += [paged.step({s: 1 for s in seqs}) for _ in range(3)]
        logits[path] = torch.cat(steps).cpu()
    scale = logits["torch"].abs().max()
    assert (logits["triton"] - logits["torch"]).abs().max() < 1e-3 * scale
