"""The server's pure parts, without a server: keys, admission, request mapping, shapes."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from llmctl.backend import GenerationOutput, TokenLogprob
from llmctl.errors import InvalidRequest
from llmctl.server.auth import ApiKeys
from llmctl.server.errors import APIError, describe_validation_errors
from llmctl.server.limits import Admission
from llmctl.server.openai_format import ChatFormatter, CompletionFormatter
from llmctl.server.protocol import ChatCompletionRequest, CompletionRequest


def test_api_keys_keep_only_digests() -> None:
    keys = ApiKeys(["alpha-key", "beta-key"])
    assert keys.required
    assert "alpha-key" not in repr(vars(keys))
    assert keys.allows("Bearer alpha-key") and keys.allows("bearer beta-key")
    for header in (None, "", "Bearer", "Bearer alpha", "Basic alpha-key", "alpha-key"):
        assert not keys.allows(header)
    assert ApiKeys(None).allows(None)  # no keys configured: open


def test_admission_bounds_running_and_waiting() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=2, max_waiting=1)
        await admission.acquire()
        await admission.acquire()
        third = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        assert (admission.running, admission.waiting) == (2, 1)
        with pytest.raises(APIError) as refused:
            await admission.acquire()
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        admission.release()
        await third
        assert (admission.running, admission.waiting) == (2, 0)
        admission.release()
        admission.release()
        assert admission.running == 0

    asyncio.run(scenario())


def test_completion_prompts_in_every_form() -> None:
    def prompts(value, n=1):
        return CompletionRequest(prompt=value, n=n).prompts()

    assert prompts("hi") == [{"prompt": "hi"}]
    assert prompts(["a", "b"]) == [{"prompt": "a"}, {"prompt": "b"}]
    assert prompts([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert prompts([[1], [2, 3]]) == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]
    for empty, where in (([], "'prompt'"), ([[1], []], "'prompt.1'")):
        with pytest.raises(ValidationError) as error:
            prompts(empty)
        message = describe_validation_errors(error.value.errors())[0]
        assert message.startswith(f"{where}: List should have at least 1 item"), message
    with pytest.raises(InvalidRequest, match="300 generations; at most 256") as error:
        prompts(["x"] * 20, n=15)
    assert (error.value.param, error.value.code) == ("prompt", "invalid_combination")


def test_sampling_fields_map_to_sampling_params() -> None:
    request = CompletionRequest(
        prompt="x",
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        stop="END",
        seed=4,
        logprobs=2,
        ignore_eos=True,
    )
    params = request.sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k) == (7, 0.5, 3)
    assert (params.stop, params.seed, params.ignore_eos) == (["END"], 4, True)
    assert params.logprobs and params.top_logprobs == 2
    chat = ChatCompletionRequest(
        messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}],
        max_tokens=9,
        max_completion_tokens=5,
    )
    assert chat.sampling_params().max_tokens == 5  # the newer field wins
    assert chat.engine_messages() == [{"role": "system", "content": "be brief"}]


def test_null_fields_take_their_defaults() -> None:
    request = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": None, "n": None, "stop": None, "stream_options": None}
    )
    assert (request.temperature, request.n, request.stop) == (1.0, 1, None)


def test_strict_types_and_unknown_fields_are_refused() -> None:
    for body in (
        {"prompt": "x", "max_tokens": "5"},
        {"prompt": "x", "stream": "yes"},
        {"prompt": "x", "best_of": 2},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    ("body", "expected", "param"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "'max_tokens'", "max_tokens"),
        ({"prompt": 5}, "'prompt' must be a string, a list of strings", "prompt"),
        ({"prompt": "x", "best_of": 2}, "unknown field 'best_of'", "best_of"),
        ({"prompt": "x", "x-odd-key": 2}, "unknown field 'x-odd-key'", "x-odd-key"),
        (
            {"prompt": "x", "stream_options": {"a-b": 1}},
            "unknown field 'stream_options.a-b'",
            "stream_options",
        ),
        ({"prompt": "x", "stop": ["s"] * 17}, "'stop': List should have at most 16 items", "stop"),
        ({}, "'prompt' is required", "prompt"),
    ],
)
def test_validation_errors_name_the_field(body: dict, expected: str, param: str) -> None:
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate(body)
    message, named = describe_validation_errors(error.value.errors())
    assert message.startswith(expected) and named == param


def entry(token: str, logprob: float, top: list[tuple[str, float]]) -> TokenLogprob:
    return TokenLogprob(0, token, logprob, [(i, t, lp) for i, (t, lp) in enumerate(top)])


def test_completion_logprobs_offsets_continue_across_chunks() -> None:
    formatter = CompletionFormatter("cmpl-1", "m", include_usage=False, num_choices=1)
    first = GenerationOutput("r", "ab", [1], 3, 1, logprobs=[entry("ab", -0.5, [("ab", -0.5)])])
    last = GenerationOutput(
        "r", "c", [2], 3, 2, True, "length", [entry("c", float("-inf"), [("d", -0.1)])]
    )
    one = formatter.stream_chunk(0, first)["choices"][0]["logprobs"]
    two = formatter.stream_chunk(0, last)["choices"][0]
    assert one == {
        "tokens": ["ab"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"ab": -0.5}],
        "text_offset": [0],
    }
    assert two["logprobs"]["text_offset"] == [2]
    assert two["logprobs"]["token_logprobs"] == [-9999.0]  # JSON has no -inf
    assert two["logprobs"]["top_logprobs"] == [{"c": -9999.0, "d": -0.1}]
    assert two["finish_reason"] == "length"


def test_chat_stream_announces_the_role_once() -> None:
    formatter = ChatFormatter("chatcmpl-1", "m", include_usage=True, num_choices=2)
    output = GenerationOutput("r", "hi", [5], 3, 1)
    first = formatter.stream_chunk(1, output)
    second = formatter.stream_chunk(1, output)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert second["choices"][0]["delta"] == {"content": "hi"}
    assert first["usage"] is None  # include_usage: null until the final usage chunk
    assert formatter.usage_chunk({"total_tokens": 4})["choices"] == []
