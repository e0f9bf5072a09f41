"""Soak: minutes of mixed traffic against a live server, checking that it stays right.

``concurrency`` clients loop until the time (or the request count) is up, each request
drawn at random: completions or chat, streamed or whole; greedy ones replay a fixed set
of cases whose answers must equal a sequential reference (the same server answering
them one at a time, before the load), sampled ones get random sampling parameters; a
share of streamed requests is dropped after a few chunks, as a client that goes away.

Reported: requests by outcome, errors by kind (5xx apart), greedy answers that differ
from the reference, the KV blocks in use once the server is idle again (must be 0) and
the server's resident memory over time (``process_resident_memory_bytes`` from
/metrics), with its growth after the first minute.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import LlmctlError

PROMPTS = (
    "Once upon a time",
    "Tom and Lily went to the park",
    "The little dog was sad because",
    "One day, a girl named Sue found a box",
    "The sun was hot and the cat",
    "Ben wanted to fly like a bird",
    "Mom said it was time for bed",
    "There was a big red ball",
)
MAX_EXAMPLES = 5
WARM_UP_S = 60.0  # RSS growth is measured from here on: allocators settle first


@dataclass(frozen=True)
class GreedyCase:
    chat: bool
    prompt: str
    max_tokens: int

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0}
        if self.chat:
            return body | {"messages": [{"role": "user", "content": self.prompt}]}
        return body | {"prompt": self.prompt}


GREEDY_CASES = tuple(
    GreedyCase(chat, prompt, max_tokens)
    for chat in (False, True)
    for prompt, max_tokens in zip(PROMPTS, (16, 24, 32, 48, 64, 20, 40, 56))
)


@dataclass
class Answer:
    """What came back: text and finish reason per choice, or why there is none."""

    status: int = 0
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str | None = None  # the kind of failure, for counting


@dataclass
class SoakSettings:
    duration_s: float | None = 600.0
    max_requests: int | None = None
    concurrency: int = 32
    disconnect_share: float = 0.2
    greedy_share: float = 0.5
    stream_share: float = 0.5
    rss_interval_s: float = 5.0
    seed: int = 0


async def reference_answers(client: Any, cases: tuple[GreedyCase, ...]) -> dict[GreedyCase, str]:
    """Each greedy case answered alone, one after another: the sequential reference."""
    reference = {}
    for case in cases:
        answer = await _send(client, case.chat, case.body(), stream=False)
        if answer.error is not None:
            raise LlmctlError(f"the reference request {case} failed: {answer.error}")
        reference[case] = answer.texts[0]
    return reference


async def run_soak(
    url: str,
    settings: SoakSettings,
    *,
    api_key: str | None = None,
    reference: dict[GreedyCase, str] | None = None,
) -> dict[str, Any]:
    """Run the soak against ``url``; the report described in the module docstring."""
    import httpx

    if settings.duration_s is None and settings.max_requests is None:
        raise LlmctlError("give the soak a duration or a number of requests")
    if settings.disconnect_share > settings.stream_share:
        raise LlmctlError("only streams are dropped: disconnect_share <= stream_share")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=settings.concurrency + 2)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=300, limits=limits
    ) as client:
        if reference is None:
            reference = await reference_answers(client, GREEDY_CASES)
        tally = _Tally()
        start = time.monotonic()
        rss: list[tuple[float, int]] = []
        sampler = asyncio.create_task(_sample_rss(client, rss, start, settings.rss_interval_s))
        planner = _Planner(settings, list(reference), start)
        await asyncio.gather(
            *(_worker(client, planner, reference, tally) for _ in range(settings.concurrency))
        )
        duration = time.monotonic() - start
        idle = await _wait_until_idle(client)
        sampler.cancel()
        rss.append((time.monotonic() - start, await _rss(client)))
    return {
        "duration_s": duration,
        "concurrency": settings.concurrency,
        "requests": sum(tally.outcomes.values()),
        "outcomes": dict(tally.outcomes),
        "errors": dict(tally.errors),
        "server_errors": sum(n for kind, n in tally.errors.items() if kind.startswith("HTTP 5")),
        "error_examples": tally.error_examples,
        "greedy_checked": tally.outcomes["greedy"],
        "greedy_mismatches": len(tally.mismatches),
        "mismatch_examples": tally.mismatches[:MAX_EXAMPLES],
        "kv_blocks_used_when_idle": idle["llmctl_kv_blocks_used"],
        "idle": idle,
        "rss_bytes": rss,
        **_rss_growth(rss),
    }


class _Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()  # greedy, sampled, disconnected, error
        self.errors: Counter[str] = Counter()
        self.error_examples: list[str] = []
        self.mismatches: list[dict[str, Any]] = []

    def error(self, kind: str, detail: str) -> None:
        self.outcomes["error"] += 1
        self.errors[kind] += 1
        if len(self.error_examples) < MAX_EXAMPLES:
            self.error_examples.append(f"{kind}: {detail}"[:300])


@dataclass(frozen=True)
class _Plan:
    """One request to send: greedy (checked against the reference), sampled, or a
    stream dropped after ``keep`` chunks."""

    kind: str
    chat: bool
    body: dict[str, Any]
    stream: bool
    case: GreedyCase | None = None
    keep: int | None = None


class _Planner:
    """Hands out requests until the duration or the request count is used up. One seeded
    generator draws them in order, so the mix of a run does not depend on timing."""

    def __init__(self, settings: SoakSettings, cases: list[GreedyCase], start: float) -> None:
        self.settings = settings
        self.cases = cases
        self.rng = random.Random(settings.seed)
        self.deadline = None if settings.duration_s is None else start + settings.duration_s
        self.left = settings.max_requests

    def next(self) -> _Plan | None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return None
        if self.left is not None:
            if self.left <= 0:
                return None
            self.left -= 1
        rng, settings = self.rng, self.settings
        stream = rng.random() < settings.stream_share
        greedy = rng.random() < settings.greedy_share
        case = rng.choice(self.cases)
        chat, body = (case.chat, case.body()) if greedy else _sampled(rng)
        if stream and rng.random() < settings.disconnect_share / settings.stream_share:
            return _Plan("disconnected", chat, body, stream, keep=rng.randint(1, 3))
        return _Plan(
            "greedy" if greedy else "sampled", chat, body, stream, case if greedy else None
        )


async def _worker(
    client: Any, planner: _Planner, reference: dict[GreedyCase, str], tally: _Tally
) -> None:
    while (plan := planner.next()) is not None:
        answer = await _send(client, plan.chat, plan.body, stream=plan.stream, keep=plan.keep)
        if plan.kind == "disconnected":
            tally.outcomes["disconnected"] += 1
            continue
        problem = answer.error
        if problem is None and plan.kind == "sampled":
            problem = _malformed(answer, plan.body.get("n", 1))
        if problem is not None:
            tally.error(problem, json.dumps(plan.body))
            continue
        tally.outcomes[plan.kind] += 1
        if plan.case is not None and answer.texts[0] != reference[plan.case]:
            tally.mismatches.append(
                {"case": str(plan.case), "stream": plan.stream, "expected": reference[plan.case]}
                | {"got": answer.texts[0]}
            )


def _sampled(rng: random.Random) -> tuple[bool, dict[str, Any]]:
    """A request with random sampling parameters, within what the API accepts."""
    body: dict[str, Any] = {
        "max_tokens": rng.randint(4, 64),
        "temperature": round(rng.uniform(0.2, 1.5), 2),
        "top_p": rng.choice([1.0, 0.95, 0.5]),
        "top_k": rng.choice([0, 5, 40]),
        "min_p": rng.choice([0.0, 0.05]),
        "repetition_penalty": rng.choice([1.0, 1.1, 1.3]),
        "presence_penalty": round(rng.uniform(-1, 1), 2),
        "frequency_penalty": round(rng.uniform(-1, 1), 2),
        "n": rng.choice([1, 1, 1, 2, 3]),
    }
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.3:
        body["stop"] = rng.choice([".", ["!", "."], "the"])
    chat = rng.random() < 0.5
    if rng.random() < 0.3:
        body |= {"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 3}
    prompt = rng.choice(PROMPTS)
    if chat:
        return True, body | {"messages": [{"role": "user", "content": prompt}]}
    return False, body | {"prompt": prompt}


def _malformed(answer: Answer, n: int) -> str | None:
    if len(answer.texts) != n:
        return f"malformed: {len(answer.texts)} choices for n={n}"
    if any(reason not in ("stop", "length") for reason in answer.finish_reasons):
        return f"malformed: finish reasons {answer.finish_reasons}"
    return None


async def _send(
    client: Any, chat: bool, body: dict[str, Any], *, stream: bool, keep: int | None = None
) -> Answer:
    """One request; with ``keep``, a stream dropped after that many chunks. Failures are
    returned as ``Answer.error``, never raised."""
    import httpx

    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if not stream:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                return Answer(response.status_code, error=_http_error(response))
            choices = response.json()["choices"]
            texts = [c["message"]["content"] if chat else c["text"] for c in choices]
            return Answer(200, texts, [c["finish_reason"] for c in choices])
        async with client.stream("POST", path, json=body | {"stream": True}) as response:
            if response.status_code != 200:
                await response.aread()
                return Answer(response.status_code, error=_http_error(response))
            return await _read_stream(response, chat, body.get("n", 1), keep)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        return Answer(error=f"client: {type(exc).__name__}")


async def _read_stream(response: Any, chat: bool, n: int, keep: int | None) -> Answer:
    texts, reasons = [""] * n, [None] * n
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return Answer(200, texts, reasons)
        event = json.loads(data)
        if "error" in event:
            return Answer(200, error=f"stream error {event['error'].get('code')}")
        for choice in event["choices"]:
            i = choice["index"]
            texts[i] += (choice["delta"].get("content") or "") if chat else choice["text"]
            reasons[i] = choice["finish_reason"] or reasons[i]
        chunks += 1
        if keep is not None and chunks >= keep:
            return Answer(200)  # leaving the block closes the connection mid-stream
    return Answer(200, error="stream ended without [DONE]")


def _http_error(response: Any) -> str:
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return f"HTTP {response.status_code} {code}"


async def _metrics(client: Any) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    text = (await client.get("/metrics")).text
    samples = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            samples[name] = float(value)
    return samples


async def _rss(client: Any) -> int:
    return int((await _metrics(client)).get("process_resident_memory_bytes", 0))


async def _sample_rss(
    client: Any, samples: list[tuple[float, int]], start: float, interval_s: float
) -> None:
    while True:
        samples.append((time.monotonic() - start, await _rss(client)))
        await asyncio.sleep(interval_s)


IDLE_GAUGES = (
    "llmctl_num_requests_running",
    "llmctl_num_requests_waiting",
    "llmctl_http_requests_generating",
    "llmctl_kv_blocks_used",
)


async def _wait_until_idle(client: Any, timeout_s: float = 60.0) -> dict[str, float]:
    """The idle gauges once nothing runs (dropped streams take a moment to abort)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = await _metrics(client)
        idle = {name: metrics.get(name, -1.0) for name in IDLE_GAUGES}
        busy = idle["llmctl_num_requests_running"] or idle["llmctl_http_requests_generating"]
        if not busy or time.monotonic() > deadline:
            return idle
        await asyncio.sleep(0.2)


def _rss_growth(samples: list[tuple[float, int]]) -> dict[str, Any]:
    """Growth of RSS from the first sample after the first minute (or the first sample,
    for a shorter run) to the largest one after it."""
    after = [rss for t, rss in samples if t >= WARM_UP_S] or [rss for _, rss in samples]
    if not after or after[0] == 0:
        return {"rss_after_first_minute_bytes": None, "rss_growth_after_first_minute": None}
    return {
        "rss_after_first_minute_bytes": after[0],
        "rss_max_bytes": max(after),
        "rss_growth_after_first_minute": max(after) / after[0] - 1,
    }


def report_markdown(report: dict[str, Any]) -> str:
    """The soak's result as a Markdown table."""
    growth = report["rss_growth_after_first_minute"]
    mib = 2**20
    rows = [
        ("duration", f"{report['duration_s']:.0f} s at concurrency {report['concurrency']}"),
        ("requests", str(report["requests"])),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items()))),
        ("errors", ", ".join(f"{k}: {v}" for k, v in report["errors"].items()) or "none"),
        ("5xx answers", str(report["server_errors"])),
        (
            "greedy answers checked / differing",
            f"{report['greedy_checked']} / {report['greedy_mismatches']}",
        ),
        ("KV blocks in use when idle", f"{report['kv_blocks_used_when_idle']:.0f}"),
        (
            "RSS after the first minute",
            f"{(report['rss_after_first_minute_bytes'] or 0) / mib:.1f} MiB",
        ),
        ("RSS growth after the first minute", "n/a" if growth is None else f"{growth:+.1%}"),
    ]
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)
