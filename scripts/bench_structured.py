"""What structured output costs: compile time of unseen schemas, and throughput of a batch
half constrained (each with a schema of its own) against the same batch unconstrained.

    python scripts/bench_structured.py                  # the demo model, torch backend
    python scripts/bench_structured.py --model DIR --backend turbo --requests 32

Both batches run in the same process, on the same engine, after a warm-up; output
tokens/s counts every generated token. The unconstrained batch generates exactly as many
tokens per request as the half-constrained one did (a JSON answer ends early, and a
batch that shrinks sooner would otherwise look slower for that alone). The first-token latency of one request with a
schema the engine has not seen (its compile included) is compared with one without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmctl.api import LLM  # noqa: E402
from llmctl.backend import GenerationRequest  # noqa: E402
from llmctl.engine.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from tests.helpers.json_schemas import SCHEMAS  # noqa: E402


def fresh_schema(number: int) -> StructuredOutput:
    """A schema no engine has compiled: one of the test schemas under a new key."""
    base = dict(list(SCHEMAS.values())[number % len(SCHEMAS)])
    defs = base.pop("$defs", {})  # refs point at the root: keep the definitions there
    schema = {
        "$defs": defs,
        "type": "object",
        "properties": {f"field_{number}": base, "n": {"type": "integer", "maximum": 99}},
        "required": [f"field_{number}", "n"],
        "additionalProperties": False,
    }
    return StructuredOutput("json_schema", json.dumps(schema))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    with LLM(args.model, backend=args.backend) as llm:
        engine = llm.engine.engine  # the LLMEngine inside the AsyncEngine
        compiler = engine.grammars
        compiler.compiled(fresh_schema(10_000))  # the tokenizer table, built once
        times = []
        for number in range(20):
            started = time.perf_counter()
            compiler.compiled(fresh_schema(1_000 + number))
            times.append(time.perf_counter() - started)
        print(
            f"compile of an unseen schema: median {statistics.median(times) * 1e3:.1f} ms, "
            f"max {max(times) * 1e3:.1f} ms over {len(times)}"
        )

        prompts = [f"Request {i}: answer in JSON." for i in range(args.requests)]
        free = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)

        def run(params: list[SamplingParams]) -> tuple[float, list[int]]:
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            return time.perf_counter() - started, [len(o.token_ids) for o in outputs]

        run([free] * len(prompts))  # warm-up
        mixed = [
            SamplingParams(max_tokens=args.max_tokens, temperature=1.0, structured=fresh_schema(i))
            if i % 2
            else free
            for i in range(len(prompts))
        ]
        mixed_time, counts = run(mixed)
        # The baseline: the same requests unconstrained, each generating as many tokens
        # as it did under its schema, so both batches shrink alike as requests end.
        same_lengths = [
            SamplingParams(max_tokens=count, temperature=1.0, ignore_eos=True) for count in counts
        ]
        plain_time, plain_counts = run(same_lengths)
        assert plain_counts == counts
        tokens = sum(counts)
        plain_rate, mixed_rate = tokens / plain_time, tokens / mixed_time
        print(f"unconstrained: {tokens} tokens in {plain_time:.2f}s = {plain_rate:.0f}/s")
        print(
            f"half constrained ({len(prompts) // 2} new schemas, compiles included): "
            f"{tokens} tokens in {mixed_time:.2f}s = {mixed_rate:.0f}/s "
            f"({mixed_rate / plain_rate:.2f}x)"
        )

        async def first_token(sampling: SamplingParams, number: int) -> float:
            request = GenerationRequest(f"ttft-{number}", prompt=prompts[0], sampling=sampling)
            started = time.perf_counter()
            stream = llm.engine.generate(request)
            await stream.__anext__()
            elapsed = time.perf_counter() - started
            await stream.aclose()
            return elapsed

        async def latencies() -> tuple[list[float], list[float]]:
            plain, fresh = [], []
            for number in range(7):
                plain.append(await first_token(SamplingParams(max_tokens=4), number))
                spec = fresh_schema(5_000 + number)
                fresh.append(
                    await first_token(SamplingParams(max_tokens=4, structured=spec), 100 + number)
                )
            return plain, fresh

        plain_ttft, fresh_ttft = asyncio.run(latencies())
        plain_ms, fresh_ms = (
            statistics.median(plain_ttft) * 1e3,
            statistics.median(fresh_ttft) * 1e3,
        )
        print(
            f"first token: {plain_ms:.1f} ms without a schema, {fresh_ms:.1f} ms with an "
            f"unseen one ({fresh_ms / plain_ms:.2f}x), medians of 7"
        )


if __name__ == "__main__":
    main()
