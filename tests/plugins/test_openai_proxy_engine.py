"""The proxy engine in-process: the request it sends, the events it reads, the errors it
raises, and its ``Engine`` behaviour (abort, stats, event loops) against a real upstream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest

from llmctl.backend import GenerationOutput, GenerationRequest, SamplingParams
from llmctl.errors import InvalidRequest, UpstreamError
from llmctl.hardware import Hardware
from llmctl.model.info import ModelInfo
from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess
from tests.plugins.conftest import UPSTREAM_KEY, metric

pytest.importorskip("llmctl_openai_proxy", reason="pip install -e plugins/llmctl-openai-proxy")

from llmctl_openai_proxy.engine import ProxyEngine, create_proxy_engine  # noqa: E402
from llmctl_openai_proxy.plugin import OpenAIProxyBackend, ProxyConfig, api_root  # noqa: E402
from llmctl_openai_proxy.protocol import (  # noqa: E402
    StreamTranslator,
    sse_data,
    upstream_request,
)
from llmctl_openai_proxy.upstream import error_message, status_error  # noqa: E402


def config_for(url: str, **overrides) -> ProxyConfig:
    return ProxyConfig(**{"api_root": api_root(url), "api_key": UPSTREAM_KEY, **overrides})


@pytest.mark.parametrize(
    "url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", " http://h:8000/v1/ "]
)
def test_api_root_adds_v1_once(url: str) -> None:
    assert api_root(url) == "http://h:8000/v1"


def test_request_body_sends_extensions_only_when_they_matter() -> None:
    plain = GenerationRequest("r", prompt="Hi", sampling=SamplingParams(max_tokens=5))
    path, body = upstream_request(plain, "m")
    assert path == "/completions"
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "prompt": "Hi",
    }
    sampling = SamplingParams(
        max_tokens=7, temperature=0.5, top_k=4, seed=3, stop=["."], ignore_eos=True
    )
    sampling.logprobs, sampling.top_logprobs = True, 2
    _, body = upstream_request(
        GenerationRequest("r", prompt_token_ids=[1, 2], sampling=sampling), "m"
    )
    assert body["prompt"] == [1, 2]
    assert (body["top_k"], body["seed"], body["stop"], body["ignore_eos"]) == (4, 3, ["."], True)
    assert body["logprobs"] == 2  # legacy completions: the number of alternatives
    assert "min_p" not in body and "repetition_penalty" not in body

    messages = [{"role": "user", "content": "Hi"}]
    path, body = upstream_request(GenerationRequest("r", messages=messages, sampling=sampling), "m")
    assert path == "/chat/completions"
    assert body["messages"] == messages and "prompt" not in body
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)


def test_grammars_and_logit_bias_travel_upstream_in_openai_and_vllm_shapes() -> None:
    from llmctl.engine.sampling_params import StructuredOutput

    def body_for(spec: StructuredOutput, **kw) -> dict:
        sampling = SamplingParams(max_tokens=5, structured=spec, **kw)
        return upstream_request(GenerationRequest("r", prompt="Hi", sampling=sampling), "m")[1]

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = body_for(StructuredOutput("json_schema", json.dumps(schema)), logit_bias={7: -2.0})
    assert body["response_format"]["json_schema"]["schema"] == schema
    assert body["logit_bias"] == {"7": -2.0}
    assert body_for(StructuredOutput("json"))["response_format"] == {"type": "json_object"}
    assert body_for(StructuredOutput("regex", "a+"))["structured_outputs"] == {"regex": "a+"}
    choice = body_for(StructuredOutput("choice", '["x", "y"]'))
    assert choice["structured_outputs"] == {"choice": ["x", "y"]}
    grammar = body_for(StructuredOutput("ebnf", 'root ::= "a"'))
    assert grammar["structured_outputs"] == {"grammar": 'root ::= "a"'}
    lark = body_for(StructuredOutput("lark", 'start: "a"'))
    assert lark["structured_outputs"] == {"grammar": 'start: "a"'}


def test_prompt_logprobs_are_refused_by_name() -> None:
    sampling = SamplingParams(max_tokens=1, prompt_logprobs=1)
    with pytest.raises(InvalidRequest, match="prompt logprobs") as refused:
        upstream_request(GenerationRequest("r", prompt="Hi", sampling=sampling), "m")
    assert refused.value.param == "prompt_logprobs"


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


def test_sse_events_are_split_and_joined() -> None:
    async def events() -> list[str]:
        lines = _lines(
            ": keep-alive", "", "event: x", 'data: {"a":', "data: 1}", "", "data: [DONE]"
        )
        return [data async for data in sse_data(lines)]

    assert asyncio.run(events()) == ['{"a":\n1}', "[DONE]"]


@pytest.mark.parametrize(
    ("status", "body", "kind", "fragment"),
    [
        (
            400,
            json.dumps({"error": {"message": "prompt too long"}}),
            InvalidRequest,
            "prompt too long",
        ),
        (422, json.dumps({"detail": "bad field"}), InvalidRequest, "bad field"),
        (401, json.dumps({"error": {"message": "bad key"}}), UpstreamError, "--proxy-api-key"),
        (
            404,
            json.dumps({"object": "error", "message": "no model x"}),
            UpstreamError,
            "no model x",
        ),
        (429, "slow down", UpstreamError, "rate-limited"),
        (503, "", UpstreamError, "HTTP 503: (empty body)"),
    ],
)
def test_upstream_status_maps_to_whose_fault_it_is(status, body, kind, fragment) -> None:
    error = status_error(config_for("http://h:1"), status, body)
    assert type(error) is kind
    assert fragment in str(error)
    if kind is InvalidRequest:  # the client sees the upstream's own words
        assert str(error) == error_message(body)


def test_check_without_or_with_a_bad_url_says_what_to_pass() -> None:
    backend = OpenAIProxyBackend()
    options = {"proxy_url": None, "proxy_api_key": None, "model_name": None, "session_len": None}
    (reason,) = backend.check(ModelInfo.remote("m"), options, Hardware())
    assert reason.startswith("no upstream server given: pass --proxy-url URL")
    (reason,) = backend.check(ModelInfo.remote("m"), {**options, "proxy_url": "h:80"}, Hardware())
    assert (
        reason
        == "proxy_url='h:80' refused: expected an http:// or https:// URL such as http://host:8000"
    )


def test_a_broken_stream_is_an_upstream_error() -> None:
    chunk = {"choices": [{"index": 0, "text": "Once", "finish_reason": None}]}
    translator = StreamTranslator("r", chat=False)
    assert translator.feed(json.dumps(chunk)).text == "Once"
    with pytest.raises(UpstreamError, match="closed the stream before the generation finished"):
        translator.finish()  # the connection ended without a finish_reason
    with pytest.raises(UpstreamError, match="failed mid-stream: out of memory"):
        translator.feed(json.dumps({"error": {"message": "out of memory", "type": "server_error"}}))
    with pytest.raises(UpstreamError, match="not JSON"):
        translator.feed("<html>")


# --- against a real upstream ---------------------------------------------------------


async def collect(engine: ProxyEngine, request: GenerationRequest) -> list[GenerationOutput]:
    return [output async for output in engine.generate(request)]


def test_engine_streams_greedy_text_with_exact_usage(upstream: ServerProcess) -> None:
    case = json.loads((STORIES / "reference_greedy.json").read_text())["results"][0]
    engine = create_proxy_engine("demo", config_for(upstream.url))
    assert (engine.model_name, engine.max_model_len) == (str(STORIES), 512)
    greedy = SamplingParams(max_tokens=48, temperature=0)
    # Two event loops in turn: the engine must not keep a connection pool across them.
    for run in range(2):
        request = GenerationRequest(f"r{run}", prompt=case["prompt"], sampling=greedy)
        outputs = asyncio.run(collect(engine, request))
        assert "".join(o.text for o in outputs) == case["continuation"]
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        last = outputs[-1]
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == (
            "length",
            len(case["prompt_ids"]),
            48,
        )
    assert engine.stats().running == 0


def test_abort_closes_the_upstream_request(upstream: ServerProcess) -> None:
    engine = create_proxy_engine(str(STORIES), config_for(upstream.url))
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    aborted_before = metric(upstream.url, "llmctl_request_finished_total", '{reason="abort"}')

    async def abort_after_two() -> list[GenerationOutput]:
        outputs = []
        async for output in engine.generate(GenerationRequest("a", prompt="Once", sampling=long)):
            outputs.append(output)
            if len(outputs) == 2:
                assert engine.stats().running == 1
                with pytest.raises(InvalidRequest, match="already in use"):
                    await anext(engine.generate(GenerationRequest("a", prompt="x")))
                await engine.abort("a")
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(abort_after_two())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert outputs[-1].completion_tokens < 500
    assert engine.stats().running == 0
    for _ in range(100):  # the upstream notices the closed connection and aborts too
        if (
            metric(upstream.url, "llmctl_request_finished_total", '{reason="abort"}')
            > aborted_before
        ):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the upstream did not abort the request")


def test_wrong_key_and_dead_upstream_are_upstream_errors(upstream: ServerProcess) -> None:
    with pytest.raises(UpstreamError, match=r"HTTP 401.*check --proxy-api-key"):
        create_proxy_engine("demo", config_for(upstream.url, api_key="wrong"))
    gone = ProxyEngine(config_for("http://127.0.0.1:9"), "m", "m", max_model_len=0)
    with pytest.raises(UpstreamError, match=r"upstream http://127.0.0.1:9/v1 is unreachable"):
        asyncio.run(collect(gone, GenerationRequest("d", prompt="Once")))
