"""Greedy tokens from llmctl on each local backend (torch, turbo, transformers) equal
transformers' own ``generate`` on the same GGUF file, loaded by transformers itself
(``gguf_file=``, its own dequantizer) in float32: on tiny Llama, Qwen2 (q/k/v biases),
Mistral (one KV head) and Qwen3 (q/k norms) files in F32, F16, Q8_0, Q4_0, Q4_1 and K-quants, and on SmolLM2.

transformers' GGUF loader loads these files faithfully (test_gguf_reader checks its
tensors and llmctl's against the checkpoint), so it is the reference here.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmctl import LLM, SamplingParams
from tests.gguf.gguf_files import hf_gguf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = ("torch", "turbo", "transformers")
KINDS = ("llama-mqa", "qwen2", "mistral-one-kv-head", "qwen3")
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# Always run: every backend, kind and type at least once; the rest are slow (a daily
# draw of them runs by default, all with --all-slow).
FAST = {
    ("torch", "llama-mqa", "Q4_0"),
    ("torch", "qwen2", "Q8_0"),
    ("torch", "mistral-one-kv-head", "F16"),
    ("torch", "llama-mqa", "Q4_K"),
    ("torch", "qwen3", "Q8_0"),
    ("turbo", "llama-mqa", "F32"),
    ("turbo", "qwen2", "Q4_1"),
    ("turbo", "mistral-one-kv-head", "Q6_K"),
    ("transformers", "qwen2", "Q4_1"),
}
SMALL = {
    "device": "cpu",
    "dtype": "float32",
    "cache_block_seq_len": 16,
    "cache_max_entry_count": "64",
    "max_batch_size": 4,
}
NEW_TOKENS = 8
# (backend, kind) pairs the backend refuses by its own rules (turbo runs no Qwen3).
UNSUPPORTED = {("turbo", "qwen3")}
# Files transformers' GGUF loader cannot build (kind -> why): the checkpoint is the reference.
CHECKPOINT_REFERENCE = {
    "qwen3": "transformers' GGUF loader ignores qwen3.attention.key_length (head size 32 here)",
}


def reference_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly ``new_tokens`` long."""
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def llmctl_greedy(path, backend: str, prompts: list[list[int]], new_tokens: int, **options):
    if backend == "transformers":
        pytest.importorskip("llmctl_transformers")
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(path), backend=backend, **{**SMALL, **options}) as llm:
        assert llm.backend == backend
        return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "backend,kind,tensor_type",
    [
        pytest.param(*case, marks=() if case in FAST else pytest.mark.slow)
        for case in [(b, k, t) for b in BACKENDS for k in KINDS for t in TYPES]
        if case[:2] not in UNSUPPORTED
    ],
)
def test_greedy_tokens_equal_transformers_on_the_same_file(tiny_gguf, backend, kind, tensor_type):
    checkpoint, path = tiny_gguf(kind, tensor_type)
    if kind in CHECKPOINT_REFERENCE:
        if backend == "transformers":
            pytest.skip(CHECKPOINT_REFERENCE[kind])  # its refusal is tested below
        reference = checkpoint_with_file_matrices(checkpoint, path, tensor_type)
    else:
        reference = hf_gguf_model(path)
    rng = random.Random(f"{kind}-{tensor_type}")
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 23)]
    expected = reference_greedy(reference, prompts, NEW_TOKENS)
    assert llmctl_greedy(path, backend, prompts, NEW_TOKENS) == expected


def checkpoint_with_file_matrices(checkpoint, path, tensor_type):
    """The checkpoint's own transformers model holding the file's matrices: the reference
    where transformers' GGUF loader cannot build the model (K-quants hold random blocks,
    so their matrices come from transformers' dequantizer of the file)."""
    from tests.gguf.gguf_files import K_BLOCKS, file_matrices
    from tests.helpers.tiny_models import load_hf_model

    model = load_hf_model(checkpoint)
    if tensor_type in K_BLOCKS:
        from llmctl.model.weights import load_weights

        matrices = load_weights(path, torch.float32)  # checked against transformers' own
    else:
        matrices = file_matrices(checkpoint, tensor_type)
    model.load_state_dict(matrices, strict=False)
    return model


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    """A chat prompt for SmolLM2 and transformers' greedy answer from the same file."""
    from llmctl.model.tokenizer import Tokenizer

    question = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    prompt = Tokenizer.from_dir(smollm2).encode_chat(question)
    return prompt, reference_greedy(hf_gguf_model(smollm2), [prompt], NEW_TOKENS)[0]


@pytest.mark.parametrize(
    "backend", ["torch", "turbo", pytest.param("transformers", marks=pytest.mark.slow)]
)
def test_smollm2_greedy_tokens_equal_transformers(smollm2, smollm2_reference, backend):
    prompt, expected = smollm2_reference
    options = {"session_len": 512}
    assert llmctl_greedy(smollm2, backend, [prompt], NEW_TOKENS, **options) == [expected]


@pytest.mark.parametrize("backend", ["torch", "turbo"])
def test_linear_rope_scaling_from_the_metadata(tiny_gguf, backend):
    """transformers' GGUF loader drops rope scaling, so the reference is the checkpoint's
    own transformers model (which has it) holding the file's dequantized matrices."""
    from tests.gguf.gguf_files import file_matrices
    from tests.helpers.tiny_models import load_hf_model

    checkpoint, path = tiny_gguf("llama-linear-rope", "Q8_0")
    reference = load_hf_model(checkpoint)
    reference.load_state_dict(file_matrices(checkpoint, "Q8_0"))
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(60)]]  # positions where it shows
    expected = reference_greedy(reference, prompts, NEW_TOKENS)
    assert llmctl_greedy(path, backend, prompts, NEW_TOKENS) == expected
    unscaled = reference_greedy(hf_gguf_model(path), prompts, NEW_TOKENS)
    assert unscaled != expected  # the scaling matters on these positions


def test_transformers_refuses_a_file_whose_rope_scaling_its_loader_drops(tiny_gguf):
    from llmctl.hardware import Hardware
    from llmctl.model.info import resolve_model
    from llmctl.selection import assess, installed_backends

    pytest.importorskip("llmctl_transformers")
    _, path = tiny_gguf("llama-linear-rope", "Q8_0")
    backend = installed_backends()["transformers"]
    reasons = assess(backend, resolve_model(str(path)), {}, None, Hardware.probe(), env={}).reasons
    assert any("drops the file's rope scaling" in reason for reason in reasons), reasons


def test_transformers_refuses_a_qwen3_file_whose_head_size_its_loader_ignores(tiny_gguf):
    from llmctl.hardware import Hardware
    from llmctl.model.info import resolve_model
    from llmctl.selection import assess, installed_backends

    pytest.importorskip("llmctl_transformers")
    _, path = tiny_gguf("qwen3", "Q8_0")
    backend = installed_backends()["transformers"]
    reasons = assess(backend, resolve_model(str(path)), {}, None, Hardware.probe(), env={}).reasons
    assert any("does not read the head size" in reason for reason in reasons), reasons
