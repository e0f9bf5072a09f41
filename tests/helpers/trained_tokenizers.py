"""Small BPE tokenizers trained in the test run, one per decoder kind (GPT-2's byte-level,
Metaspace, and WordPiece's, which the byte table refuses)."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llmctl.model.tokenizer import Tokenizer

CORPUS = ["Once upon a time, a dog named Ben ran. Über café naïve 世界 你好 🙂 €5 -- ok."] * 20


def trained(kind: str, corpus: list[str] = CORPUS) -> Tokenizer:
    """A small BPE tokenizer of ``kind`` (its decoder), trained on ``corpus``."""
    if kind == "byte_level":
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        hf = HFTokenizer(models.BPE(unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Metaspace()
        hf.decoder = decoders.Metaspace() if kind == "metaspace" else decoders.WordPiece()
        alphabet = []
    special = ["<unk>", "<s>", "</s>"]
    hf.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, special_tokens=special),
    )
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>")
