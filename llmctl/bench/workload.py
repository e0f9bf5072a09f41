"""The benchmark workload: seeded random prompts (token ids) with their output lengths.

Prompts are random ids drawn from the model's vocabulary, special ids excluded, so no
request stops early on a stray EOS and no two prompts share a prefix by accident. The
same seed gives the same workload, so the engine, the baseline and every block size of
a sweep see identical requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmctl.errors import ModelError, OptionError

if TYPE_CHECKING:
    from llmctl.model.info import ModelInfo


@dataclass(frozen=True)
class LengthRange:
    """Token lengths drawn uniformly from ``low..high`` (both included); fixed when equal."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def parse_length_range(text: str, flag: str) -> LengthRange:
    """``"128"`` (fixed) or ``"16:256"`` (uniform); ``flag`` names the option in errors."""
    parts = text.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise OptionError(
            f"{flag} {text!r} is not a length: give one number (e.g. 128) or a range "
            "LOW:HIGH drawn uniformly (e.g. 16:256)"
        ) from None
    if low < 1 or high < low:
        raise OptionError(
            f"{flag} {text!r}: lengths must be at least 1 and LOW must not exceed HIGH"
        )
    return LengthRange(low, high)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    input_len: LengthRange
    output_len: LengthRange
    seed: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def longest_request(self) -> int:
        return max(len(r.prompt_token_ids) + r.output_len for r in self.requests)

    def describe(self) -> dict:
        return {
            "num_prompts": len(self.requests),
            "input_len": [self.input_len.low, self.input_len.high],
            "output_len": [self.output_len.low, self.output_len.high],
            "seed": self.seed,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }


def make_workload(
    token_ids: list[int],
    num_prompts: int,
    input_len: LengthRange,
    output_len: LengthRange,
    seed: int,
) -> Workload:
    """``num_prompts`` requests whose prompts are drawn from ``token_ids``."""
    if num_prompts < 1:
        raise OptionError(f"--num-prompts must be at least 1, got {num_prompts}")
    if not token_ids:
        raise ModelError("the model's vocabulary has no ordinary (non-special) token ids")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        prompt = rng.choices(token_ids, k=input_len.draw(rng))
        requests.append(BenchRequest(prompt, output_len.draw(rng)))
    return Workload(requests, input_len, output_len, seed)


def fixed_length_prompts(
    model: ModelInfo, num_prompts: int, input_len: int, seed: int
) -> list[list[int]]:
    """The host-work benchmarks' prompts: ``num_prompts`` of ``input_len`` ordinary ids.

    The same prompts as ``make_workload`` draws for that seed with a fixed input length.
    """
    lengths = LengthRange(input_len, input_len)
    token_ids = ordinary_token_ids(model.path, model.config)
    workload = make_workload(token_ids, num_prompts, lengths, lengths, seed)
    return [request.prompt_token_ids for request in workload.requests]


def ordinary_token_ids(model_dir: Path, config: dict) -> list[int]:
    """Ids a prompt may use: the model's vocabulary without its special tokens.

    The vocabulary is the smaller of the model's embedding rows (``vocab_size``) and the
    tokenizer's size; special ids are the tokenizer's special added tokens plus the
    BOS/EOS/PAD ids of the model config.
    """
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ModelError(f"{model_dir}/config.json has no valid vocab_size")
    special = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        special.update(value if isinstance(value, list) else [value] if value is not None else [])
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        spec = json.loads(tokenizer_file.read_text())
        special.update(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
        vocab_size = min(vocab_size, _tokenizer_size(spec))
    return [i for i in range(vocab_size) if i not in special]


def _tokenizer_size(spec: dict) -> int:
    """Number of ids the tokenizer knows (model vocab plus added tokens)."""
    vocab = spec.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t["id"] for t in spec.get("added_tokens", [])]
    return max(ids) + 1 if ids else 0
