"""Online load against an OpenAI-compatible server: streaming ``/v1/completions``.

Each request sends its prompt as token ids with ``max_tokens`` and ``ignore_eos``, greedy,
and streams the answer. Measured per request: time to first token (TTFT), time per
output token after the first (TPOT) and the gaps between streamed chunks (ITL). Load is
bounded by ``concurrency`` (requests in flight), paced by ``request_rate`` (Poisson
arrivals, seeded), or both.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

from llmctl.bench.metrics import summarize
from llmctl.bench.workload import BenchRequest, Workload
from llmctl.errors import LlmctlError

MAX_ERROR_EXAMPLES = 5


async def served_model_name(url: str, api_key: str | None) -> str:
    """The first model ``/v1/models`` lists, for when ``--model`` is not given."""
    import httpx

    async with httpx.AsyncClient(base_url=url, headers=_headers(api_key), timeout=30) as client:
        try:
            response = await client.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise LlmctlError(
                f"could not ask {url}/v1/models which model it serves ({exc}); "
                "is the server up? Pass --model NAME to skip this question"
            ) from None


async def run_serve_load(
    url: str,
    model: str,
    workload: Workload,
    *,
    concurrency: int | None,
    request_rate: float | None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    on_done: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Send every request of ``workload`` to ``url``; return the measured figures."""
    import httpx

    if concurrency is None and request_rate is None:
        raise LlmctlError("give --concurrency N, --request-rate R, or both")
    if concurrency is not None and concurrency < 1:
        raise LlmctlError(f"--concurrency must be at least 1, got {concurrency}")
    if request_rate is not None and request_rate <= 0:
        raise LlmctlError(f"--request-rate must be positive, got {request_rate}")
    slots = asyncio.Semaphore(concurrency or len(workload.requests))
    arrivals = random.Random(workload.seed)
    limits = httpx.Limits(max_connections=concurrency or len(workload.requests))
    async with httpx.AsyncClient(
        base_url=url, headers=_headers(api_key), timeout=timeout_s, limits=limits
    ) as client:

        async def one(request: BenchRequest) -> dict[str, Any]:
            async with slots:
                result = await _stream_completion(client, model, request)
            if on_done is not None:
                on_done()
            return result

        start = time.perf_counter()
        tasks = []
        for request in workload.requests:
            tasks.append(asyncio.create_task(one(request)))
            if request_rate is not None:
                await asyncio.sleep(arrivals.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    done = [r for r in results if r["error"] is None]
    errors = [r["error"] for r in results if r["error"] is not None]
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    output_tokens = sum(r["output_tokens"] for r in done)
    to_ms = 1000.0
    return {
        "duration_s": duration,
        "num_requests": len(results),
        "completed": len(done),
        "errors": len(errors),
        "error_examples": list(dict.fromkeys(errors))[:MAX_ERROR_EXAMPLES],
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": workload.output_tokens,
        "requests_per_s": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summarize([r["ttft_s"] * to_ms for r in done]),
        "tpot_ms": summarize([r["tpot_s"] * to_ms for r in done if r["tpot_s"] is not None]),
        "itl_ms": summarize([gap * to_ms for r in done for gap in r["itl_s"]]),
        "latency_ms": summarize([r["latency_s"] * to_ms for r in done]),
    }


async def _stream_completion(client: Any, model: str, request: BenchRequest) -> dict[str, Any]:
    """One streamed request; failures are returned as ``error``, never raised."""
    import httpx

    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result: dict[str, Any] = {"error": None, "prompt_tokens": len(request.prompt_token_ids)}
    chunk_times: list[float] = []
    usage = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return {**result, "error": f"HTTP {response.status_code}: {text}"}
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return {**result, "error": f"stream error: {chunk['error']}"}
                if chunk.get("choices"):
                    chunk_times.append(time.perf_counter())
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return {**result, "error": f"{type(exc).__name__}: {exc}"}
    if not chunk_times:
        return {**result, "error": "the stream ended without a token"}
    # Usage counts tokens exactly; without it, count one token per streamed chunk.
    tokens = usage["completion_tokens"] if usage else len(chunk_times)
    if usage:
        result["prompt_tokens"] = usage.get("prompt_tokens", result["prompt_tokens"])
    ttft = chunk_times[0] - start
    latency = chunk_times[-1] - start
    return {
        **result,
        "output_tokens": tokens,
        "ttft_s": ttft,
        "latency_s": latency,
        "tpot_s": (latency - ttft) / (tokens - 1) if tokens > 1 else None,
        "itl_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
    }


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
