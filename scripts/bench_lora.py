"""Multi-LoRA throughput: 32 requests spread over 4 adapters against the same 32 on the base
model alone, in one process (issue 29's goal: at least 0.8x the base's tokens/s).

The model is the CPU reference workload's 24M random Llama (``make_random_llama.py``);
the adapters are random rank-16 LoRA adapters of every projection (q/k/v/o/gate/up/down),
written in PEFT's format. Each run is greedy with ``ignore_eos``, so both runs generate
exactly the same number of tokens; the two are interleaved (base, LoRA, base, LoRA...)
and the best of each is kept, so a busy neighbour hurts both alike.

    python scripts/bench_lora.py                 # torch backend, CPU
    python scripts/bench_lora.py --backend turbo # turbo's native CPU LoRA kernel
    python scripts/bench_lora.py --repeats 3 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from safetensors.numpy import save_file

from llmctl import LLM, SamplingParams
from llmctl.model.check import expected_tensors
from llmctl.model.config import ModelConfig
from llmctl.model.lora import TARGET_MODULES

ADAPTERS = 4


def write_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of every target module of ``config``'s model."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (shape, _) in expected_tensors(config).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith(TARGET_MODULES):
            out_features, in_features = shape
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * rng.standard_normal(
                (rank, in_features), "f4"
            )
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * rng.standard_normal(
                (out_features, rank), "f4"
            )
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))


def run(llm: LLM, prompts: list[list[int]], loras: list[str | None], output_len: int) -> float:
    """Tokens per second of one batch of ``prompts``."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora=loras)
    seconds = time.perf_counter() - started
    tokens = sum(len(out.token_ids) for out in outputs)
    assert tokens == len(prompts) * output_len
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: a 24M random Llama)")
    parser.add_argument("--backend", default="torch", help="torch or turbo (CPU)")
    parser.add_argument("--quantization", default="none", help="the base weights: none or int8")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model_dir = Path(args.model) if args.model else root / "llama-24m"
        if not args.model:
            from make_random_llama import make_random_llama

            make_random_llama(model_dir)
        config = ModelConfig.from_dir(model_dir)
        loras = {}
        for index in range(ADAPTERS):
            loras[f"lora{index}"] = str(root / f"lora{index}")
            write_adapter(root / f"lora{index}", config, args.rank, seed=index)
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, config.vocab_size) for _ in range(args.input_len)]
            for _ in range(args.requests)
        ]
        names = [f"lora{i % ADAPTERS}" for i in range(args.requests)]
        with LLM(
            str(model_dir),
            backend=args.backend,
            lora=loras,
            max_loras=ADAPTERS,
            max_lora_rank=args.rank,
            quantization=args.quantization,
            enable_prefix_caching=False,  # every run computes its prompts
        ) as llm:
            run(llm, prompts[:4], names[:4], 4)  # warm up both paths
            base, adapted = [], []
            for _ in range(args.repeats):
                base.append(run(llm, prompts, [None] * args.requests, args.output_len))
                adapted.append(run(llm, prompts, names, args.output_len))

    table = Table(
        title=f"{args.backend}, {args.requests} requests, {args.input_len} in / "
        f"{args.output_len} out, quantization {args.quantization}"
    )
    for column in ("run", "tokens/s (best)", "runs", "ratio"):
        table.add_column(column)
    table.add_row("base model", f"{max(base):.1f}", ", ".join(f"{t:.1f}" for t in base), "1.00")
    table.add_row(
        f"{ADAPTERS} adapters, rank {args.rank}",
        f"{max(adapted):.1f}",
        ", ".join(f"{t:.1f}" for t in adapted),
        f"{max(adapted) / max(base):.2f}",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
