"""Prometheus metrics of one app (own registry, so tests can build several apps in a process).

Other subsystems add their own collectors to `ApiMetrics.registry` (for example the structured
output counters of live grammar states and cached grammars).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """Engine gauges read at scrape time: waiting/running requests, KV blocks."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self):
        try:
            s = self._stats()
        except Exception:
            return
        for attr, name, doc in (
            ("num_running", "atom_num_requests_running", "Requests being generated"),
            ("num_waiting", "atom_num_requests_waiting", "Requests waiting to be scheduled"),
            ("num_free_blocks", "atom_kv_cache_free_blocks", "Free KV cache blocks"),
            ("num_total_blocks", "atom_kv_cache_total_blocks", "All KV cache blocks"),
        ):
            value = getattr(s, attr, None)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))


_STRUCTURED_OUTPUT_METRICS = (
    (
        GaugeMetricFamily,
        "atom_structured_output_live_grammar_states",
        "Per-request grammar states held by workers (bound, not yet released)",
        "live_grammar_states",
    ),
    (
        GaugeMetricFamily,
        "atom_structured_output_cached_grammars",
        "Compiled grammars in the workers' bounded caches",
        "cached_grammars",
    ),
    (
        GaugeMetricFamily,
        "atom_structured_output_prepared_schemas",
        "Checked and lowered schemas in the server's bounded cache",
        "prepared_schemas",
    ),
    (
        CounterMetricFamily,
        "atom_structured_output_schema_preparations",
        "Schema preparations run in a worker process (cache misses)",
        "schema_preparations",
    ),
)


class _StructuredOutputCollector(Collector):
    """Structured-output gauges over every rank, read at scrape time (0 when never used); the
    scrape reads worker counters directly and imports nothing of `atom.structured_output`."""

    def __init__(self, stats: Callable[[], dict[str, int]]):
        self._stats = stats

    def collect(self):
        try:
            s = self._stats()
        except Exception:
            return
        for family, name, doc, key in _STRUCTURED_OUTPUT_METRICS:
            yield family(name, doc, value=float(s.get(key, 0)))


class ApiMetrics:
    def __init__(
        self,
        engine_stats: Callable[[], Any] | None = None,
        structured_output_stats: Callable[[], dict[str, int]] | None = None,
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "atom_requests",
            "Finished API requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "atom_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("atom_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "atom_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "atom_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "atom_e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        if engine_stats is not None:
            r.register(_EngineCollector(engine_stats))
        if structured_output_stats is not None:
            r.register(_StructuredOutputCollector(structured_output_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, endpoint: str) -> RequestTracker:
        return RequestTracker(self, endpoint)


class RequestTracker:
    """Latency bookkeeping of one request."""

    def __init__(self, metrics: ApiMetrics, endpoint: str):
        self.m = metrics
        self.endpoint = endpoint
        self.start = time.perf_counter()
        self.last: float | None = None
        self.done = False

    def prompt(self, n: int) -> None:
        self.m.prompt_tokens.inc(n)

    def tokens(self, n: int, first_token_time: float | None = None) -> None:
        """`n` tokens arrived now; `first_token_time`: when the engine read the first of them
        (`RequestOutput.first_token_time`: a request whose outputs come all at the end), else
        they are taken to have come now."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            first = now if first_token_time is None else first_token_time
            self.m.ttft.observe(first - self.start)
            n_itl, self.last = n - 1, first
        else:
            n_itl = n
        if n_itl > 0:
            gap = (now - self.last) / n_itl
            for _ in range(n_itl):
                self.m.itl.observe(gap)
        self.last = now
        self.m.generation_tokens.inc(n)

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        if self.last is not None:
            self.m.e2e.observe(time.perf_counter() - self.start)
        self.m.requests.labels(endpoint=self.endpoint, outcome=outcome).inc()
