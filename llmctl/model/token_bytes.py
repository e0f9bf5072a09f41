"""Each token's bytes in decoded text, for tokenizers whose decoder only concatenates.

Most tokenizers decode by turning every token into bytes and joining them: GPT-2's
byte-level BPE (GPT-2, Llama 3, Qwen, Mistral Nemo) and the SentencePiece shapes
(``▁`` for a space, ``<0xNN>`` byte tokens, one leading space dropped). For those,
the text a new token adds is its bytes after the bytes before it, and incremental
detokenization needs no call of the tokenizer at all, where a ``tokenizers`` decode
costs more than the rest of a sequence's work in an engine step.

``token_pieces`` reads the decoder's configuration and builds the table for the
decoder steps it knows (``ByteLevel``, ``Metaspace``, ``Replace`` of a plain string,
``ByteFallback``, ``Fuse``, a leading ``Strip``); any other decoder gets ``None`` and
the detokenizer decodes windows of tokens instead. The table is checked against the
tokenizer's own ``decode`` before use.
"""

from __future__ import annotations

import json
import random
import weakref
from dataclasses import dataclass
from functools import cached_property

from tokenizers import Tokenizer as HFTokenizer

from llmctl.model.tokenizer import Tokenizer

# Text whose every character the checks below must reproduce: spaces, punctuation and
# 2-, 3- and 4-byte UTF-8 characters, which byte-fallback tokenizers spell byte by byte.
_CHECK_TEXT = "Once upon a time, Ünïcødé  spaces\nnew line 世界 🙂 €5 - done."


@dataclass(frozen=True)
class TokenPieces:
    """``pieces[id]``: the bytes token ``id`` adds to the text. ``texts[id]``: the same as
    a string when those bytes are complete UTF-8 on their own, else ``None``.
    ``first_pieces`` replaces ``pieces`` for the first token of a text (a Metaspace
    decoder drops its ``▁``). ``strip_start``: how many leading ``strip_char`` the text
    loses (a ``Strip`` after ``Fuse``)."""

    pieces: list[bytes]
    texts: list[str | None]
    first_pieces: list[bytes] | None
    special: frozenset[int]
    strip_char: str
    strip_start: int

    @cached_property
    def texts_without_special(self) -> list[str | None]:
        """``texts`` with the special tokens' text empty (``skip_special_tokens``)."""
        return ["" if i in self.special else text for i, text in enumerate(self.texts)]

    @cached_property
    def untabled(self) -> frozenset[int]:
        """The ids whose text is no table entry (``texts`` has ``None``)."""
        return frozenset(i for i, text in enumerate(self.texts) if text is None)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """What the tokenizer's ``decode`` returns, from the table."""
        ids = [t for t in token_ids if not (skip_special_tokens and t in self.special)]
        return strip_leading(self.joined_text(ids), self.strip_char, self.strip_start)[0]

    def joined_text(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (none of them skipped) before the leading strip."""
        if not token_ids:
            return ""
        first = (self.first_pieces or self.pieces)[token_ids[0]]
        rest = [self.pieces[t] for t in token_ids[1:]]
        return b"".join([first, *rest]).decode("utf-8", "replace")


def strip_leading(text: str, char: str, count: int) -> tuple[str, int]:
    """Drop up to ``count`` leading ``char``; return the rest and the count left (0 once
    any other character is seen)."""
    cut = 0
    while cut < min(count, len(text)) and text[cut] == char:
        cut += 1
    if cut < len(text):
        return text[cut:], 0
    return text[cut:], count - cut


_cache: weakref.WeakKeyDictionary[Tokenizer, TokenPieces | None] = weakref.WeakKeyDictionary()


def token_pieces(tokenizer: Tokenizer) -> TokenPieces | None:
    """The table for ``tokenizer``, or ``None`` if its decoder does more than concatenate
    (computed once per tokenizer)."""
    if tokenizer not in _cache:
        pieces = _build(tokenizer.hf_tokenizer)
        _cache[tokenizer] = pieces if pieces is not None and _agrees(pieces, tokenizer) else None
    return _cache[tokenizer]


def _build(hf: HFTokenizer) -> TokenPieces | None:
    if hf.decoder is None:  # tokens joined with spaces
        return None
    config = json.loads(hf.decoder.__getstate__())
    steps = config["decoders"] if config["type"] == "Sequence" else [config]
    to_bytes = _compile(steps)
    if to_bytes is None:
        return None
    piece_of, first_of, strip_char, strip_start = to_bytes
    added = hf.get_added_tokens_decoder()
    vocab_size = hf.get_vocab_size(with_added_tokens=True)
    strings = [""] * vocab_size
    for token, token_id in hf.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            strings[token_id] = token
    for token_id, token in added.items():
        if token_id < vocab_size:
            strings[token_id] = token.content
    pieces = [piece_of(s) for s in strings]
    return TokenPieces(
        pieces=pieces,
        texts=[_complete_text(p) for p in pieces],
        first_pieces=[first_of(s) for s in strings] if first_of else None,
        special=frozenset(i for i, token in added.items() if token.special),
        strip_char=strip_char,
        strip_start=strip_start,
    )


def _complete_text(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _compile(steps: list[dict]):
    """The per-token transform of a decoder's steps: (piece, first piece or None, strip
    char, strip count), or None if some step is not a plain per-token rewrite."""
    string_steps = []  # str -> str, applied in order
    first_steps = None  # the same for the first token, when it differs
    byte_level = byte_fallback = fused = False
    strip_char, strip_start = " ", 0
    for step in steps:
        kind = step["type"]
        if byte_level or byte_fallback and kind not in ("Fuse", "Strip"):
            return None  # bytes must be the last per-token step
        if kind == "Replace" and "String" in step["pattern"] and not fused:
            old, new = step["pattern"]["String"], step["content"]
            string_steps.append(lambda s, old=old, new=new: s.replace(old, new))
        elif kind == "Metaspace" and not fused:
            mark = step["replacement"]
            first_steps = list(string_steps)
            if step.get("prepend_scheme", "always") != "never":
                first_steps.append(lambda s, mark=mark: s.replace(mark, ""))
            else:
                first_steps.append(lambda s, mark=mark: s.replace(mark, " "))
            string_steps.append(lambda s, mark=mark: s.replace(mark, " "))
        elif kind == "ByteLevel" and not fused:
            byte_level = True
        elif kind == "ByteFallback" and not fused:
            byte_fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and step["stop"] == 0 and strip_start == 0:
            strip_char, strip_start = step["content"], step["start"]
        else:
            return None

    def finish(transforms):
        def piece(token: str) -> bytes:
            for transform in transforms:
                token = transform(token)
            if byte_level:
                return _byte_level_bytes(token)
            if byte_fallback and _is_byte_token(token):
                return bytes([int(token[3:5], 16)])
            return token.encode("utf-8")

        return piece

    first = finish(first_steps) if first_steps is not None else None
    return finish(string_steps), first, strip_char, strip_start


def _is_byte_token(token: str) -> bool:
    if len(token) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return False
    try:
        int(token[3:5], 16)
    except ValueError:
        return False
    return True


def _gpt2_char_bytes() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_CHAR_BYTES = _gpt2_char_bytes()


def _byte_level_bytes(token: str) -> bytes:
    """A ByteLevel token's bytes; a token with other characters (an added token) is its
    own UTF-8, as the ByteLevel decoder does."""
    try:
        return bytes(_CHAR_BYTES[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _agrees(pieces: TokenPieces, tokenizer: Tokenizer) -> bool:
    """Whether the table decodes like the tokenizer on a mixed text and on random token
    sequences (those that decode to whole characters; broken bytes may differ only in
    how many U+FFFD they become)."""
    hf = tokenizer.hf_tokenizer
    samples = [hf.encode(_CHECK_TEXT, add_special_tokens=False).ids]
    rng = random.Random(0)
    size = len(pieces.pieces)
    samples += [[rng.randrange(size) for _ in range(rng.randrange(1, 6))] for _ in range(300)]
    samples += [[token_id] for token_id in sorted(pieces.special)]
    for ids in samples:
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip)
            if "\ufffd" not in expected and pieces.decode(ids, skip) != expected:
                return False
    return True
