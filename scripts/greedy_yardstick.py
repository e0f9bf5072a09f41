"""How far other weight precisions already move greedy tokens: a yardstick for int8.

    python scripts/greedy_yardstick.py                 # stories260K, torch backend, CPU

``llmctl bench quality``'s greedy agreement (steps up to each prompt's first difference,
over all steps; its 16 prompts x 64 tokens) of float32 against bfloat16 and float16
weights, beside int8 weights: on a small model many steps are near-ties, and any
rounding flips some of them. Prints one table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmctl import LLM, SamplingParams
from llmctl.bench.quality import PROMPTS, first_difference

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
MAX_TOKENS = 64
VARIANTS = (
    {"dtype": "bfloat16"},
    {"dtype": "float16"},
    {"dtype": "float32", "quantization": "int8"},
)


def greedy_tokens(model: Path, backend: str, **options) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLM(str(model), backend=backend, device="cpu", enable_prefix_caching=False,
             **options) as llm:  # fmt: skip
        prompts = [llm.engine.tokenizer.encode(prompt) for prompt in PROMPTS]
        return [output.token_ids for output in llm.generate(prompts, params)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=STORIES)
    parser.add_argument("--backend", default="torch")
    args = parser.parse_args()
    reference = greedy_tokens(args.model, args.backend, dtype="float32")
    print(f"\nGreedy agreement with float32, {args.model.name}, {args.backend}, "
          f"{len(PROMPTS)} prompts x {MAX_TOKENS} tokens\n")  # fmt: skip
    print("| weights | greedy agreement |\n|---|---|")
    for variant in VARIANTS:
        tokens = greedy_tokens(args.model, args.backend, **variant)
        agreeing = sum(first_difference(r, t) for r, t in zip(reference, tokens))
        label = ", ".join(f"{key}={value}" for key, value in variant.items())
        print(f"| {label} | {agreeing / (MAX_TOKENS * len(reference)):.1%} |")


if __name__ == "__main__":
    main()
