"""Incremental detokenization with stop strings, one instance per request.

Text is produced the way vLLM does it: decode a short window of tokens before the new
ones (``prefix_offset .. read_offset``) and the same window plus the new ones, and
emit the difference. Decoding with context keeps the spaces and merges a tokenizer
only gets right in context, and text ending in U+FFFD (an incomplete UTF-8 character
split over tokens) is held back until the next token completes it.

Stop strings are matched in the accumulated text, so a stop string spread over
several tokens is found. While streaming, a tail that could still become a stop
string is held back; on a match the text is cut exactly before the stop string (or
after it, with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first generated token (vLLM uses 5).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = sampling.skip_special_tokens
        self._stops = list(sampling.stop)
        self._include_stop = sampling.include_stop_str_in_output
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""  # everything decoded so far (cut at a stop string)
        self._emitted = 0  # how much of ``text`` has been handed out
        self.stopped = False  # a stop string was found

    def add_token(self, token_id: int) -> None:
        """Decode one more generated token and look for stop strings."""
        if self.stopped:
            return
        self._token_ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._token_ids[self._prefix_offset : self._read_offset], self._skip_special
        )
        full_text = decode(self._token_ids[self._prefix_offset :], self._skip_special)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return  # nothing new yet, or a character still incomplete
        previous_len = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._find_stop(previous_len)

    def take_new_text(self, final: bool = False) -> str:
        """Text not handed out yet; unless ``final``, minus a tail that may start a stop."""
        end = len(self.text)
        if not (final or self.stopped or self._include_stop):
            end = max(self._emitted, end - self._possible_stop_start())
        new_text = self.text[self._emitted : end]
        self._emitted = end
        return new_text

    def _find_stop(self, previous_len: int) -> None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # A match must involve new text, so it starts at most len(stop)-1 chars back.
            index = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            index, stop = best
            self.text = self.text[: index + len(stop) if self._include_stop else index]
            self.stopped = True

    def _possible_stop_start(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
