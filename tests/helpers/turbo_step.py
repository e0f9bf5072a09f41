"""turbo's native step against transformers' logits, on sequences driven as the engine
drives them; shared by the CPU tests (test_native_step.py) and the GPU ones
(test_cuda_kernels.py)."""

from __future__ import annotations

import torch
from llmctl_turbo.runner import TurboModelRunner

from llmctl.model.config import ModelConfig
from tests.helpers.tiny_models import PagedSequences

TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def hf_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def check_against_transformers(
    model_dir, block_size: int, num_blocks: int = 64, device: str = "cpu"
) -> None:
    config = ModelConfig.from_dir(model_dir)
    runner = TurboModelRunner(
        model_dir, config, block_size=block_size, num_blocks=num_blocks, device=device
    )
    generator = torch.Generator().manual_seed(block_size)
    lengths = [block_size + 7, 3, 2 * block_size + 1]
    prompts = [
        torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in lengths
    ]
    # Extra tokens each sequence decodes one at a time after its prompt.
    for prompt in prompts:
        prompt += torch.randint(3, config.vocab_size, (4,), generator=generator).tolist()
    driver = PagedSequences(runner, seed=1)
    seqs = [driver.add(p) for p in prompts]
    expected = [hf_logits(model_dir, p) for p in prompts]

    def run(counts: dict[int, int]) -> None:
        logits = driver.step(counts)
        assert logits.dtype == torch.float32 and logits.shape == (len(counts), config.vocab_size)
        for row, seq in enumerate(counts):
            position = driver.cached[seq] - 1
            torch.testing.assert_close(logits[row].cpu(), expected[seq][position], **TOLERANCE)

    # A whole prompt, the first chunk of another, a short prompt: one step.
    run({seqs[0]: lengths[0], seqs[2]: block_size - 1, seqs[1]: lengths[1]})
    # The rest of the chunked prompt beside two decodes.
    run({seqs[0]: 1, seqs[2]: lengths[2] - (block_size - 1), seqs[1]: 1})
    for _ in range(3):  # decode only
        run({seq: 1 for seq in seqs})
