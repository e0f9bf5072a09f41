"""Incremental detokenization with stop strings, one instance per request.

For most tokenizers a token adds fixed bytes to the text (``token_bytes``): the new
text is the new token's bytes after any bytes still held back, and no tokenizer call
is needed. Other tokenizers are decoded the way vLLM does it: decode a short window
of tokens before the new ones (``prefix_offset .. read_offset``) and the same window
plus the new ones, and emit the difference. Decoding with context keeps the spaces
and merges a tokenizer only gets right in context. Either way, text ending in U+FFFD
(an incomplete UTF-8 character split over tokens) is held back until the next token
completes it.

Stop strings are matched in the accumulated text, so a stop string spread over
several tokens is found. While streaming, a tail that could still become a stop
string is held back; on a match the text is cut exactly before the stop string (or
after it, with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from llmctl.engine.sampling_params import SamplingParams
from llmctl.model.token_bytes import strip_leading, token_pieces
from llmctl.model.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first generated token (vLLM uses 5).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """``use_pieces=False`` decodes windows even where the byte table would do (tests
    compare the two)."""

    # Slots: the engine reads ``plain_texts`` once per request per step, right after the
    # model call, when a dictionary of attributes is one more cache miss.
    __slots__ = (
        "_tokenizer",
        "_skip_special",
        "_stops",
        "_include_stop",
        "_text",
        "_emitted",
        "stopped",
        "plain_texts",
        "_pieces",
        "_token_ids",
        "_prefix_offset",
        "_read_offset",
        "_first",
        "_pending",
        "_strip_left",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        use_pieces: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = sampling.skip_special_tokens
        self._stops = list(sampling.stop)
        self._include_stop = sampling.include_stop_str_in_output
        # Without stop strings: the text not handed out yet. With them: everything
        # decoded so far (cut at a stop string), of which ``_emitted`` chars went out.
        self._text = ""
        self._emitted = 0
        self.stopped = False  # a stop string was found
        # While a token's text is only its entry in this table (the byte table is used,
        # no stop strings, no character half done, nothing left to strip): the table, and
        # ``take_new_text`` has nothing else to give. The engine then reads a token's text
        # here instead of calling ``add_token`` and ``take_new_text``; else ``None``.
        self.plain_texts: list[str | None] | None = None
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._pieces = token_pieces(tokenizer) if use_pieces else None
        if self._pieces is None:
            self._token_ids = context
            self._prefix_offset = 0
            self._read_offset = len(context)
            return
        pieces = self._pieces
        visible = [t for t in context if not (self._skip_special and t in pieces.special)]
        self._first = not visible  # the next visible token starts the text
        self._pending = b""  # bytes of a character not complete yet
        # Leading characters the text still loses: what the context left of the strip.
        _, self._strip_left = strip_leading(
            pieces.joined_text(visible), pieces.strip_char, pieces.strip_start
        )
        self._update_plain()

    def _update_plain(self) -> None:
        plain = not (self._stops or self._first or self._pending or self._strip_left)
        pieces = self._pieces
        self.plain_texts = (
            (pieces.texts_without_special if self._skip_special else pieces.texts)
            if plain
            else None
        )

    def add_token(self, token_id: int) -> None:
        """Decode one more generated token and look for stop strings."""
        if self.stopped:
            return
        pieces = self._pieces
        if pieces is None:
            self._add_by_window(token_id)
            return
        if token_id >= len(pieces.pieces) or (self._skip_special and token_id in pieces.special):
            return  # an embedding row past the vocabulary decodes to nothing, as in decode
        text = None
        if self._first:
            piece = (pieces.first_pieces or pieces.pieces)[token_id]
            self._first = False
        else:
            piece = pieces.pieces[token_id]
            if not self._pending:
                text = pieces.texts[token_id]
        if text is None:
            data = self._pending + piece
            text = data.decode("utf-8", "replace")
            if text.endswith("\ufffd"):
                self._pending = data
                self.plain_texts = None
                return
            self._pending = b""
        if self._strip_left:
            text, self._strip_left = strip_leading(text, pieces.strip_char, self._strip_left)
        if text:
            self._append(text)
        if self.plain_texts is None:
            self._update_plain()

    def _add_by_window(self, token_id: int) -> None:
        self._token_ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._token_ids[self._prefix_offset : self._read_offset], self._skip_special
        )
        full_text = decode(self._token_ids[self._prefix_offset :], self._skip_special)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return  # nothing new yet, or a character still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._append(full_text[len(prefix_text) :])

    def _append(self, text: str) -> None:
        previous_len = len(self._text)
        self._text += text
        if self._stops:
            self._find_stop(previous_len)

    def take_new_text(self, final: bool = False) -> str:
        """Text not handed out yet; unless ``final``, minus a tail that may start a stop."""
        if not self._stops:
            new_text, self._text = self._text, ""
            return new_text
        end = len(self._text)
        if not (final or self.stopped or self._include_stop):
            end = max(self._emitted, end - self._possible_stop_start())
        new_text = self._text[self._emitted : end]
        self._emitted = end
        return new_text

    def _find_stop(self, previous_len: int) -> None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # A match must involve new text, so it starts at most len(stop)-1 chars back.
            index = self._text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            index, stop = best
            self._text = self._text[: index + len(stop) if self._include_stop else index]
            self.stopped = True

    def _possible_stop_start(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
