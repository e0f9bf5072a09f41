"""Incremental detokenization: whole characters only, stop strings cut exactly.

Two ways to the same text: the byte table (``token_bytes``) for tokenizers whose decoder
only concatenates, and window decoding for any tokenizer. Every streaming test runs
both on stories260K's tokenizer (SentencePiece style with byte fallback); tokenizers
built here cover GPT-2's byte-level decoder, Metaspace and a decoder the table refuses.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.sampling_params import SamplingParams
from llmctl.model.token_bytes import token_pieces
from llmctl.model.tokenizer import Tokenizer
from tests.helpers.trained_tokenizers import CORPUS, trained

# ASCII words and spaces mixed with 2-, 3- and 4-byte UTF-8 characters, which the
# stories260K tokenizer spells as one byte-fallback token per byte.
ALPHABET = list("abc xyz.,") + ["é", "ß", "世", "界", "🙂", "€"]
texts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30).map("".join)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(params=[True, False], ids=["byte_table", "windows"])
def use_pieces(request) -> bool:
    return request.param


def stream(tokenizer, prompt_ids, output_ids, params, use_pieces=True):
    """Feed tokens one at a time as the engine does; return the deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params, use_pieces)
    deltas = []
    for i, token in enumerate(output_ids):
        detok.add_token(token)
        last = detok.stopped or i == len(output_ids) - 1
        deltas.append(detok.take_new_text(final=last))
        if detok.stopped:
            break
    return deltas, detok


def whole_text(tokenizer, prompt_ids, output_ids) -> str:
    """The reference: what decoding prompt + output at once adds after the prompt."""
    full = tokenizer.decode(prompt_ids + output_ids)
    prompt = tokenizer.decode(prompt_ids)
    assert full.startswith(prompt)
    return full[len(prompt) :]


@SETTINGS
@given(prompt=texts, text=texts)
def test_streamed_text_equals_whole_decode_without_broken_characters(
    stories_tokenizer, use_pieces, prompt, text
) -> None:
    prompt_ids = stories_tokenizer.encode(prompt)
    output_ids = stories_tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = stream(stories_tokenizer, prompt_ids, output_ids, SamplingParams(), use_pieces)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == whole_text(stories_tokenizer, prompt_ids, output_ids)


def test_split_multibyte_character_is_held_back(stories_tokenizer, use_pieces) -> None:
    output_ids = stories_tokenizer.encode("a🙂", add_special_tokens=False)
    assert len(output_ids) == 5  # 'a' and the four bytes of the emoji
    deltas, _ = stream(stories_tokenizer, [1], output_ids, SamplingParams(), use_pieces)
    assert deltas == ["a", "", "", "", "🙂"]


@SETTINGS
@given(text=texts, data=st.data(), include=st.booleans())
def test_stop_string_cuts_exactly_across_tokens(
    stories_tokenizer, use_pieces, text, data, include
) -> None:
    output_ids = stories_tokenizer.encode(text, add_special_tokens=False)
    full = whole_text(stories_tokenizer, [1], output_ids)
    start = data.draw(st.integers(0, max(0, len(full) - 1)))
    stop = full[start : start + data.draw(st.integers(1, 4))] or "#"
    other = data.draw(st.sampled_from(["zz", "é世", "#"]))
    params = SamplingParams(stop=[stop, other], include_stop_str_in_output=include)
    deltas, detok = stream(stories_tokenizer, [1], output_ids, params, use_pieces)

    hits = [(full.find(s), s) for s in (stop, other) if full.find(s) != -1]
    if not hits:
        assert not detok.stopped and "".join(deltas) == full
        return
    # A stop string wins unless another one ends before it starts; two that overlap
    # (``zz`` and ``zza``) depend on which is complete first.
    possible = [(i, s) for i, s in hits if not any(j + len(t) <= i for j, t in hits)]
    assert detok.stopped
    expected = {full[: i + len(s)] if include else full[:i] for i, s in possible}
    assert "".join(deltas) in expected
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_is_never_streamed_in_part(stories_tokenizer, use_pieces) -> None:
    ids = stories_tokenizer.encode("Once upon a time, there was", add_special_tokens=False)
    params = SamplingParams(stop=["a time"])
    deltas, detok = stream(stories_tokenizer, [1], ids, params, use_pieces)
    assert detok.stopped
    # ' a' is held back as the possible start of the stop string, then dropped with it.
    assert deltas == ["Once", " upon", " ", ""]


def test_possible_stop_prefix_is_released_when_no_stop_follows(
    stories_tokenizer, use_pieces
) -> None:
    ids = stories_tokenizer.encode("Once upon a dog", add_special_tokens=False)
    params = SamplingParams(stop=["a time"])
    deltas, _ = stream(stories_tokenizer, [1], ids, params, use_pieces)
    # 'a' is held back while it could start "a time", and released with the next token.
    assert deltas == ["Once", " upon", " ", "a do", "g"]


def test_skip_special_tokens(stories_tokenizer, use_pieces) -> None:
    ids = [403, 2, 407]  # 'Once', '</s>', 'upon'
    params = SamplingParams(skip_special_tokens=False)
    kept, _ = stream(stories_tokenizer, [1], ids, params, use_pieces)
    skipped, _ = stream(stories_tokenizer, [1], ids, SamplingParams(), use_pieces)
    assert "</s>" in "".join(kept)
    assert "".join(skipped) == "Once upon"


def test_the_byte_table_is_built_only_for_decoders_that_concatenate(stories_tokenizer) -> None:
    assert token_pieces(stories_tokenizer) is not None  # Replace, ByteFallback, Fuse, Strip
    assert token_pieces(trained("byte_level")) is not None
    assert token_pieces(trained("metaspace")) is not None
    assert token_pieces(trained("wordpiece")) is None  # "##" merges: not a concatenation
    no_decoder = trained("metaspace")
    no_decoder.hf_tokenizer.decoder = None  # tokens joined with spaces
    assert token_pieces(no_decoder) is None


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "wordpiece"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_other_decoders_stream_their_whole_decode(kind, data) -> None:
    tokenizer = _trained_once(kind)
    words = CORPUS[0].split(" ")
    text = " ".join(data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=12)))
    prompt_ids = tokenizer.encode(data.draw(st.sampled_from(words)))
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    for use_pieces in (True, False):
        deltas, _ = stream(tokenizer, prompt_ids, output_ids, SamplingParams(), use_pieces)
        assert "".join(deltas) == whole_text(tokenizer, prompt_ids, output_ids)


def test_the_byte_table_calls_no_decode(stories_tokenizer, monkeypatch) -> None:
    calls = []
    real_decode = stories_tokenizer.decode
    monkeypatch.setattr(
        stories_tokenizer, "decode", lambda *args: calls.append(args) or real_decode(*args)
    )
    ids = stories_tokenizer.encode("Once upon a time 世界 🙂", add_special_tokens=False)
    deltas, _ = stream(stories_tokenizer, [1], ids, SamplingParams(stop=["zz"]))
    assert "".join(deltas) == "Once upon a time 世界 🙂" and calls == []
    stream(stories_tokenizer, [1], ids, SamplingParams(), use_pieces=False)
    assert len(calls) >= 2 * len(ids)


_TRAINED: dict[str, Tokenizer] = {}


def _trained_once(kind: str) -> Tokenizer:
    if kind not in _TRAINED:
        _TRAINED[kind] = trained(kind)
    return _TRAINED[kind]


def test_ids_past_the_tokenizers_vocabulary_decode_to_nothing(stories_tokenizer, use_pieces):
    """Models often have more embedding rows than their tokenizer has tokens."""
    ids = [403, stories_tokenizer.vocab_size + 3, 407]  # 'Once', past the end, 'upon'
    deltas, _ = stream(stories_tokenizer, [1], ids, SamplingParams(), use_pieces)
    assert "".join(deltas) == "Once upon"
