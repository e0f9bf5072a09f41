"""Incremental detokenization: whole characters only, stop strings cut exactly."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.sampling_params import SamplingParams

# ASCII words and spaces mixed with 2-, 3- and 4-byte UTF-8 characters, which the
# stories260K tokenizer spells as one byte-fallback token per byte.
ALPHABET = list("abc xyz.,") + ["é", "ß", "世", "界", "🙂", "€"]
texts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30).map("".join)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tokenizer, prompt_ids, output_ids, params):
    """Feed tokens one at a time as the engine does; return the deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
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
    stories_tokenizer, prompt, text
) -> None:
    prompt_ids = stories_tokenizer.encode(prompt)
    output_ids = stories_tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = stream(stories_tokenizer, prompt_ids, output_ids, SamplingParams())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == whole_text(stories_tokenizer, prompt_ids, output_ids)


def test_split_multibyte_character_is_held_back(stories_tokenizer) -> None:
    output_ids = stories_tokenizer.encode("a🙂", add_special_tokens=False)
    assert len(output_ids) == 5  # 'a' and the four bytes of the emoji
    deltas, _ = stream(stories_tokenizer, [1], output_ids, SamplingParams())
    assert deltas == ["a", "", "", "", "🙂"]


@SETTINGS
@given(text=texts, data=st.data(), include=st.booleans())
def test_stop_string_cuts_exactly_across_tokens(stories_tokenizer, text, data, include) -> None:
    output_ids = stories_tokenizer.encode(text, add_special_tokens=False)
    full = whole_text(stories_tokenizer, [1], output_ids)
    start = data.draw(st.integers(0, max(0, len(full) - 1)))
    stop = full[start : start + data.draw(st.integers(1, 4))] or "#"
    other = data.draw(st.sampled_from(["zz", "é世", "#"]))
    params = SamplingParams(stop=[stop, other], include_stop_str_in_output=include)
    deltas, detok = stream(stories_tokenizer, [1], output_ids, params)

    hits = [i for i in (full.find(stop), full.find(other)) if i != -1]
    if not hits:
        assert not detok.stopped and "".join(deltas) == full
        return
    first = min(hits)
    matched = stop if full.find(stop) == first else other
    assert detok.stopped
    expected = full[: first + len(matched)] if include else full[:first]
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_is_never_streamed_in_part(stories_tokenizer) -> None:
    ids = stories_tokenizer.encode("Once upon a time, there was", add_special_tokens=False)
    deltas, detok = stream(stories_tokenizer, [1], ids, SamplingParams(stop=["a time"]))
    assert detok.stopped
    # ' a' is held back as the possible start of the stop string, then dropped with it.
    assert deltas == ["Once", " upon", " ", ""]


def test_possible_stop_prefix_is_released_when_no_stop_follows(stories_tokenizer) -> None:
    ids = stories_tokenizer.encode("Once upon a dog", add_special_tokens=False)
    deltas, _ = stream(stories_tokenizer, [1], ids, SamplingParams(stop=["a time"]))
    # 'a' is held back while it could start "a time", and released with the next token.
    assert deltas == ["Once", " upon", " ", "a do", "g"]


def test_skip_special_tokens(stories_tokenizer) -> None:
    ids = [403, 2, 407]  # 'Once', '</s>', 'upon'
    kept, _ = stream(stories_tokenizer, [1], ids, SamplingParams(skip_special_tokens=False))
    skipped, _ = stream(stories_tokenizer, [1], ids, SamplingParams())
    assert "</s>" in "".join(kept)
    assert "".join(skipped) == "Once upon"
