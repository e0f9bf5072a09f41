"""A GGUF file's tokenizer, built in the ``tokenizers`` library from its metadata.

A GGUF has no tokenizer.json: it stores the vocabulary (``tokenizer.ggml.tokens``), the
merges, the token types and the special ids under llama.cpp's key names. Two kinds of
vocabulary cover the models llmctl runs:

- ``gpt2``: byte-level BPE (Llama 3, Qwen, SmolLM...). How text is split before the
  merges depends on ``tokenizer.ggml.pre``, the pre-tokenizer llama.cpp applies;
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral, TinyStories...),
  merges from the file or rebuilt from the scores when it has none.

Control tokens (``<|im_start|>``) become special added tokens, user-defined ones plain
added tokens, so both stay whole in text. The chat template is the metadata's
``tokenizer.chat_template``, compiled as any model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from llmctl.errors import ModelError

if TYPE_CHECKING:
    from llmctl.model.gguf import GGUFModel

# Pre-tokenizer regexes of llama.cpp's ``tokenizer.ggml.pre`` names (llama-vocab.cpp).
# Not listed: GPT-2's own split (the ByteLevel pre-tokenizer's regex).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}
# These split every digit off first, then split as GPT-2 does (SmolLM's own tokenizer.json
# has Digits(individual_digits) before ByteLevel).
DIGIT_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "minerva")
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def tokenizer_arguments(model: GGUFModel) -> dict[str, Any]:
    """The arguments of the llmctl ``Tokenizer`` the metadata of ``model`` describes (its
    chat template included): ``Tokenizer.from_gguf`` builds it."""
    kind = model.value("tokenizer.ggml.model")
    tokens = model.value("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(
            f"{model.path} has no vocabulary (tokenizer.ggml.tokens) in its metadata; "
            "convert it again with a current llama.cpp (convert_hf_to_gguf.py)"
        )
    types = model.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level(model, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece(model, tokens)
    else:
        raise ModelError(
            f"{model.path}: its tokenizer is of kind {kind!r} (tokenizer.ggml.model); llmctl "
            "builds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) tokenizers"
        )
    _add_special_tokens(tokenizer, tokens, types)
    special = {
        name: tokens[token_id]
        for name, key in SPECIAL_IDS.items()
        if (token_id := model.value(f"tokenizer.ggml.{key}")) is not None
        and 0 <= token_id < len(tokens)
    }
    add_bos = model.value("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = kind == "llama"
    template = model.value("tokenizer.chat_template")
    return dict(
        tokenizer=tokenizer,
        bos_token=special.get("bos_token"),
        eos_token=special.get("eos_token"),
        add_bos_token=bool(add_bos),
        add_eos_token=bool(model.value("tokenizer.ggml.add_eos_token", False)),
        eos_token_ids=tuple(model.eos_ids()),
        chat_template=template,
        chat_template_file=model.path if template else None,
        special_tokens=special,
    )


def _byte_level(model: GGUFModel, tokens: list[str]) -> HFTokenizer:
    """GPT-2's byte-level BPE: tokens are spelled in its byte alphabet already."""
    merges = [tuple(merge.split(" ", 1)) for merge in model.value("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = model.value("tokenizer.ggml.pre")
    prefix = bool(model.value("tokenizer.ggml.add_space_prefix", False))
    if pre in PRE_TOKENIZER_SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False),
            ]
        )
    elif pre in DIGIT_PRE_TOKENIZERS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=prefix),
            ]
        )
    else:  # "gpt2", "default" and the rest: GPT-2's own split
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(model: GGUFModel, tokens: list[str]) -> HFTokenizer:
    """SentencePiece BPE as transformers' LlamaTokenizer builds it: ``▁`` for spaces (one
    before the text unless add_space_prefix is false), bytes as ``<0x41>`` tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = model.value("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = model.value("tokenizer.ggml.scores") or [0.0] * len(tokens)
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk_id = model.value("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tokenizer = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(model.value("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a token into two
    tokens, best-scored merged token first (as transformers' ``generate_merges``)."""
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tokenizer: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens as special added tokens, user-defined ones as plain
    added tokens: llama.cpp matches all of them whole in text."""
    control = [t for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)]
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
