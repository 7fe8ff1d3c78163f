"""Prometheus metrics (prefix `plait_`) in a registry owned by one app.

Engine gauges and counters are read from `engine.stats()` when /metrics is scraped (the
engine keeps the totals; nothing is double counted here). Per-request histograms and the
success and refusal counters are observed by the HTTP layer as requests pass through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# engine.stats() key -> (metric name without prefix, help)
_GAUGES = {
    "num_running": ("num_requests_running", "Sub-requests running in the engine."),
    "num_waiting": ("num_requests_waiting", "Sub-requests waiting for a running slot."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)."),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks in use (requests and kept prompts)."),
    "kv_blocks_held_by_requests": ("kv_blocks_held_by_requests",
                                   "KV cache blocks referenced by live requests (0 at rest)."),
    "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool."),
}
_COUNTERS = {
    "prompt_tokens_computed": ("prompt_tokens_computed", "Prompt tokens run through the model."),
    "prompt_tokens_cached": ("prompt_tokens_cached", "Prompt tokens served from the cache."),
    "generation_tokens": ("generation_tokens", "Generated tokens."),
    "num_preemptions": ("num_preemptions", "Sub-requests preempted (recomputed later)."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the cache."),
}


class EngineCollector(Collector):
    """Exports the engine's own stats at scrape time; nothing while it is not loaded."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or {}
        for key, (name, doc) in _GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(f"plait_{name}", doc, value=float(stats[key]))
        for key, (name, doc) in _COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(f"plait_{name}", doc, value=float(stats[key]))

    def describe(self) -> Iterator[Metric]:
        return iter(())


class ServerMetrics:
    """The app's registry plus the metrics the HTTP layer observes."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any] | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine_stats))
        kw: dict[str, Any] = {"registry": self.registry}
        self.request_success = Counter(
            "plait_request_success", "Choices finished, by finish reason.", ["finish_reason"],
            **kw)
        for reason in ("stop", "length"):
            self.request_success.labels(reason)
        self.time_to_first_token = Histogram(
            "plait_time_to_first_token_seconds", "Arrival to first token, per choice.",
            buckets=TTFT_BUCKETS, **kw)
        self.inter_token_latency = Histogram(
            "plait_inter_token_latency_seconds", "Time between tokens of a choice.",
            buckets=ITL_BUCKETS, **kw)
        self.e2e_request_latency = Histogram(
            "plait_e2e_request_latency_seconds", "Arrival to last token, per HTTP request.",
            buckets=E2E_BUCKETS, **kw)
        self.requests_refused = Counter(
            "plait_requests_refused", "HTTP requests refused with 503: overloaded (the "
            "admission limit), unavailable (loading, draining, engine stopped).", ["reason"],
            **kw)
        for reason in ("overloaded", "unavailable"):
            self.requests_refused.labels(reason)
        self.request_n = Histogram(
            "plait_request_n", "Choices requested (n, or best_of) per prompt.",
            buckets=N_BUCKETS, **kw)

    def render(self) -> bytes:
        return generate_latest(self.registry)
