"""``quantization=gguf`` on turbo: a GGUF file's Q8_0 / Q4_0 / Q4_1 matrices run as their
blocks (turbo's CPU block kernels, int8 activations per 32-block as llama.cpp), against
the same file dequantized to float32 (``quantization=none``) on the same runner.

- SmolLM2-135M-Instruct Q4_1 (the default model's file): each position's logits over a
  real prompt within LOGITS_TOLERANCE of the dequantized float32 ones, and greedy choices
  along float32's greedy answers agree with float32's about as often as the same file
  dequantized to bfloat16 does (the precision the project already ships);
- a tiny random Llama written as Q8_0 here with the ``gguf`` package: the same logits
  check, and a whole engine run (``LLM.generate``);
- the same tiny Llama written as each K-quant (Q4_K, Q5_K, Q6_K: its weights quantized by
  ``tests.gguf.k_quants``, as gguf-py cannot quantize them), every matrix run as its blocks
  (the load's log line says so): logits close, greedy tokens equal, and a whole engine run;
- the rules: torch and transformers refuse ``gguf`` with a reason, turbo refuses it for
  a Hugging Face directory and in float16.
"""

from __future__ import annotations

import logging

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.model.tokenizer import Tokenizer
from tests.gguf.gguf_files import write_gguf
from tests.gguf.native_runs import greedy, prompt_logits, turbo_runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The largest logit error, relative to the position's largest |logit|: measured 0.054 on
# SmolLM2 Q4_1 (int8 activations through 30 layers; bfloat16 weights: 0.045).
LOGITS_TOLERANCE = 0.1
PROMPTS = (
    "The capital of France is",
    "Once upon a time, there was a little girl who",
    "def fibonacci(n):\n    ",
    "The three laws of thermodynamics are",
)
STEPS = 64


def max_relative_error(got, ref) -> float:
    return float(((got - ref).abs().max(-1).values / ref.abs().max(-1).values).max())


@pytest.fixture(scope="module")
def smollm2_runners(smollm2):
    tokens = 256
    return {
        "gguf": turbo_runner(smollm2, "gguf", tokens),
        "float32": turbo_runner(smollm2, "none", tokens),
    }


def test_smollm2_q4_1_logits_close_to_dequantized_float32(smollm2, smollm2_runners):
    ids = Tokenizer.from_dir(smollm2).encode(" ".join(PROMPTS))
    native = prompt_logits(smollm2_runners["gguf"], ids)
    reference = prompt_logits(smollm2_runners["float32"], ids)
    assert max_relative_error(native, reference) <= LOGITS_TOLERANCE
    # Teacher-forced next tokens: near-ties aside, the same.
    assert (native.argmax(-1) == reference.argmax(-1)).double().mean() >= 0.9


# More prompts for the greedy comparison: code, recipes, arithmetic, history, prose.
GREEDY_PROMPTS = PROMPTS + (
    "Water boils at",
    "Here is a recipe for pancakes:",
    "The best way to learn a new language is",
    "import numpy as np\n\ndef normalize(x):",
    "In 1492, Columbus",
    "Photosynthesis is the process by which",
    "My favourite season is autumn because",
    "Q: What is 12 times 7?\nA:",
)


@pytest.mark.slow
def test_smollm2_q4_1_greedy_as_faithful_as_bfloat16(smollm2, smollm2_runners):
    """Greedy choices along float32's own greedy answers (each step fed float32's
    tokens): native Q4_1 picks float32's next token about as often as the file
    dequantized to bfloat16 does. Free-running agreement (each runner fed its own
    tokens) is not compared: one near-tie flipped by float rounding sends a run down
    another path, so a prompt's figure jumps between 0.1 and 1.0 when the attention's
    summation order changes, for either runner (measured on these 12 prompts)."""
    tokenizer = Tokenizer.from_dir(smollm2)
    runners = {
        "native": smollm2_runners["gguf"],
        "bfloat16": turbo_runner(smollm2, "none", 256, dtype="bfloat16"),
    }
    agreed = dict.fromkeys(runners, 0)
    steps = 0
    for text in GREEDY_PROMPTS:
        prompt = tokenizer.encode(text)
        reference = greedy(smollm2_runners["float32"], prompt, STEPS)
        for name, runner in runners.items():
            choices = prompt_logits(runner, prompt + reference)[len(prompt) - 1 : -1].argmax(-1)
            agreed[name] += int((choices == torch.tensor(reference)).sum())
        steps += len(reference)
    native, bfloat16 = agreed["native"] / steps, agreed["bfloat16"] / steps
    # Measured: 0.978 (native Q4_1) against 0.987 (bfloat16), over 12 x 64 steps.
    assert native >= bfloat16 - 0.02 and native >= 0.95


def test_tiny_q8_0_file_runs_natively(tiny_gguf):
    _, path = tiny_gguf("llama-mqa", "Q8_0")
    ids = [1, 17, 250, 3, 99, 400, 12, 7, 311, 58, 2, 64]
    native = prompt_logits(turbo_runner(path, "gguf", 64), ids)
    reference = prompt_logits(turbo_runner(path, "none", 64), ids)
    assert max_relative_error(native, reference) <= LOGITS_TOLERANCE
    # The whole engine, with the option as a user gives it.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", cache_block_seq_len=16, max_batch_size=2)
    with LLM(str(path), backend="turbo", quantization="gguf", **options) as llm:
        (output,) = llm.generate([ids], params)
    assert len(output.token_ids) == 8


@pytest.mark.parametrize("tensor_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_tiny_k_quant_file_runs_natively(tiny_checkpoint, tmp_path, tensor_type, caplog):
    # The checkpoint's weights as K-quants (random blocks would make a model whose
    # attention is a hard argmax, where int8 activations flip a choice now and then).
    path = write_gguf(
        tiny_checkpoint("llama-mqa", wide=True),
        tmp_path / f"llama-mqa-{tensor_type}.gguf",
        tensor_type,
        quantized_k_blocks=True,
    )
    with caplog.at_level(logging.INFO, logger="llmctl"):
        native_runner = turbo_runner(path, "gguf", 64)
    (line,) = [r.getMessage() for r in caplog.records if "quantization: gguf" in r.getMessage()]
    # Every matrix (and the tied LM head) as blocks; only the lookup table dequantized.
    assert f"as {tensor_type}, " in line and "dequantized to" not in line, line
    reference_runner = turbo_runner(path, "none", 64)
    ids = [1, 17, 250, 3, 99, 400, 12, 7, 311, 58, 2, 64]
    native = prompt_logits(native_runner, ids)
    reference = prompt_logits(reference_runner, ids)
    assert max_relative_error(native, reference) <= LOGITS_TOLERANCE
    # Free-running greedy tokens: each one the float32 reference's own choice on the same
    # path, or within a near-tie of it (a tiny random model's top logits are often closer
    # than int8 activations' error: measured 2-6 % of the largest logit, margins 0.3-26 %).
    prompt = ids[:5]
    tokens = greedy(native_runner, prompt, 16)
    along = prompt_logits(reference_runner, prompt + tokens)[len(prompt) - 1 : -1]
    chosen = along.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = (along.max(-1).values - chosen) / along.abs().max(-1).values
    assert gap.max() <= LOGITS_TOLERANCE, gap
    # The whole engine, with the option as a user gives it: the runner's tokens.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", cache_block_seq_len=16, max_batch_size=2)
    with LLM(str(path), backend="turbo", quantization="gguf", **options) as llm:
        (output,) = llm.generate([prompt], params)
    assert output.token_ids == tokens[:8]


@pytest.mark.parametrize(
    ("backend", "message"),
    [("torch", "no kernels for GGUF blocks"), ("transformers", "dequantizes a GGUF file")],
)
def test_other_backends_refuse_gguf(tiny_gguf, backend, message):
    if backend == "transformers":
        pytest.importorskip("llmctl_transformers")
    _, path = tiny_gguf("llama-mqa", "Q8_0")
    with pytest.raises(Exception, match=message):
        LLM(str(path), backend=backend, device="cpu", quantization="gguf")


def test_turbo_refuses_gguf_without_a_gguf_file(tiny_checkpoint, tiny_gguf):
    with pytest.raises(Exception, match="is not one; use quantization none or int8"):
        LLM(str(tiny_checkpoint("llama-mqa")), backend="turbo", device="cpu", quantization="gguf")
    _, path = tiny_gguf("llama-mqa", "Q8_0")
    with pytest.raises(Exception, match="float32 or bfloat16 activations, not float16"):
        LLM(str(path), backend="turbo", device="cpu", dtype="float16", quantization="gguf")
