"""Create a randomly initialised Llama for benchmarks (default: ~24M parameters).

The default shape is the one docs/benchmarks.md measures: hidden 512, intermediate
1408, 8 layers, 8 heads, 4 KV heads, vocabulary 512. Weights are seeded, saved as
safetensors with transformers; the tokenizer files are copied from a model with the
same vocabulary size (stories260K's by default, whose vocabulary is 512).

    python scripts/make_random_llama.py /tmp/llama-24m
    llmctl bench throughput /tmp/llama-24m --input-len 16:256 --output-len 16:256
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "stories260K"


def make_random_llama(
    out_dir: Path,
    *,
    hidden_size: int = 512,
    intermediate_size: int = 1408,
    num_layers: int = 8,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tokenizer_from: Path = DEFAULT_TOKENIZER,
    seed: int = 0,
) -> int:
    """Write the model to ``out_dir``; return its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (tokenizer_from / "tokenizer.json").is_file():
        raise SystemExit(
            f"no tokenizer.json in {tokenizer_from}: pass --tokenizer-from with a model "
            f"directory whose vocabulary has {vocab_size} tokens"
        )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out_dir / name)
    return sum(p.numel() for p in model.parameters())


def default_random_llama(out_dir: Path) -> Path:
    """The default 24M model in ``out_dir``, made there first if absent (for benchmarks)."""
    if not (out_dir / "config.json").is_file():
        make_random_llama(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="Directory to write the model into.")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--intermediate-size", type=int, default=1408)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--tokenizer-from", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    count = make_random_llama(
        args.out_dir,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        tokenizer_from=args.tokenizer_from,
        seed=args.seed,
    )
    print(f"wrote a random Llama with {count / 1e6:.1f}M parameters to {args.out_dir}")


if __name__ == "__main__":
    main()
