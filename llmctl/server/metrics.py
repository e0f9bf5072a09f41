"""Prometheus metrics at ``GET /metrics`` (left open, like /health: it holds counts and
timings, never prompts or keys; put the server behind a proxy to restrict it).

Counters and histograms are updated as requests run; the engine's gauges (running and
waiting sequences, KV blocks) are read from ``Engine.stats()`` at scrape time, so they
are never stale. The process's own figures (``process_resident_memory_bytes``, open
files, CPU time) come from prometheus-client's process collector. Each app has its own
registry, so several servers can live in one process (tests) without clashing.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmctl.backend import Engine, EngineStats
from llmctl.server.limits import Admission

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5)


class _LiveGauges(Collector):
    """Gauges read when Prometheus scrapes: the engine's stats and the admission line."""

    def __init__(self, engine: Engine, admission: Admission) -> None:
        self.engine = engine
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        values = [
            ("llmctl_num_requests_running", "Sequences the engine is generating.", stats.running),
            ("llmctl_num_requests_waiting", "Sequences waiting in the engine.", stats.waiting),
            ("llmctl_kv_blocks_used", "KV-cache blocks in use.", stats.kv_blocks_used),
            (
                "llmctl_kv_blocks_peak",
                "Most KV-cache blocks in use at once since the start.",
                stats.kv_blocks_peak,
            ),
            ("llmctl_kv_blocks_free", "KV-cache blocks free.", stats.kv_blocks_free),
            ("llmctl_kv_blocks_total", "KV-cache blocks in the cache.", stats.kv_blocks_total),
            ("llmctl_kv_block_size_tokens", "Tokens per KV-cache block.", stats.block_size),
            (
                "llmctl_tensor_parallel_size",
                "Ranks the model is sharded over.",
                stats.tensor_parallel_size,
            ),
            (
                "llmctl_http_requests_generating",
                "HTTP requests holding a generation slot.",
                self.admission.running,
            ),
            (
                "llmctl_http_requests_queued",
                "HTTP requests waiting for a generation slot.",
                self.admission.waiting,
            ),
        ]
        for name, documentation, value in values:
            yield GaugeMetricFamily(name, documentation, value=value)
        yield from _speculation_counters(stats)


def _speculation_counters(stats: EngineStats) -> Iterator[Metric]:
    """Speculative decoding's tokens, proposed and accepted, in all and by position."""
    for name, documentation, total, by_position in (
        (
            "llmctl_spec_decode_proposed_tokens",
            "Tokens proposed by speculative decoding.",
            stats.spec_proposed,
            stats.spec_proposed_by_position,
        ),
        (
            "llmctl_spec_decode_accepted_tokens",
            "Proposed tokens the model accepted.",
            stats.spec_accepted,
            stats.spec_accepted_by_position,
        ),
    ):
        yield CounterMetricFamily(name, documentation, value=total)
        family = CounterMetricFamily(
            name + "_by_position", documentation + " By position in the step.", labels=["position"]
        )
        for position, value in enumerate(by_position):
            family.add_metric([str(position)], value)
        yield family


class ServerMetrics:
    def __init__(self, engine: Engine, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "llmctl_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "llmctl_prompt_tokens", "Prompt tokens processed.", registry=registry
        )
        self.generation_tokens = Counter(
            "llmctl_generation_tokens", "Tokens generated.", registry=registry
        )
        self.finished = Counter(
            "llmctl_request_finished",
            "Finished generations (choices), by finish reason.",
            ["reason"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "llmctl_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "llmctl_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per generation.",
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        registry.register(_LiveGauges(engine, admission))
        ProcessCollector(registry=registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
