"""Prometheus metrics (prefix `plait_`) in a registry owned by one app, plus the vLLM names
that inference routers scrape (`vllm:`, see `VLLM_GAUGES`).

Engine gauges and counters are read from `engine.stats()` (an `EngineStats`) when /metrics
is scraped (the engine keeps the totals; nothing is double counted here). Per-request
histograms and the success and refusal counters are observed by the HTTP layer as requests
pass through it.

The `vllm:` series are the model-server metrics protocol of the Gateway API Inference
Extension's endpoint picker (llm-d-router `docs/plugin-metric-protocol.md`) and the vLLM
production-stack router, with vLLM's names, types and labels (`vllm/v1/metrics/loggers.py`):
labels `model_name` (the served name) and `engine` ("0": one engine core). They are the
same `EngineStats` fields as their `plait_` twins, read in the same scrape. Running and waiting
count engine sub-requests (one per choice of n, or of best_of), as vLLM V1 counts the child
requests of an n > 1 request: queue depth in units of engine work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plait.engine import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# One exported series: (name, help, value read from the engine's snapshot).
Series = tuple[str, str, float]


def plait_gauges(s: EngineStats) -> list[Series]:
    return [
        ("plait_num_requests_running", "Sub-requests running in the engine.", s.num_running),
        ("plait_num_requests_waiting", "Sub-requests waiting for a running slot.",
         s.num_waiting),
        ("plait_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
         s.kv_cache_usage),
        ("plait_kv_blocks_used", "KV cache blocks referenced by live requests (0 at rest: "
         "kept prompts name cached blocks, they hold none).", s.kv_blocks_used),
        ("plait_kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total),
        ("plait_model_weight_bytes", "Bytes the model's weights hold in memory (kept in the "
         "file's format, plus float copies).", s.model_weight_bytes),
    ]


def plait_counters(s: EngineStats) -> list[Series]:
    return [
        ("plait_prompt_tokens_computed", "Prompt tokens run through the model.",
         s.prompt_tokens_computed),
        ("plait_prompt_tokens_cached", "Prompt tokens served from the cache.",
         s.prompt_tokens_cached),
        ("plait_generation_tokens", "Generated tokens.", s.generation_tokens),
        ("plait_num_preemptions", "Sub-requests preempted (recomputed later).",
         s.num_preemptions),
        ("plait_prefix_cache_queries", "Prompt tokens looked up in the cache.",
         s.prefix_cache_queries),
        ("plait_prefix_cache_hits", "Prompt tokens found in the cache.", s.prefix_cache_hits),
        ("plait_kv_events_dropped", "KV-cache event batches the publisher never sent (its "
         "queue was full, or no subscriber took them before the held backlog filled).",
         s.kv_events_dropped),
    ]


# vLLM's names and help. `gpu_cache_usage_perc` and the `gpu_` prefix-cache counters are
# vLLM's deprecated names, still read by the production-stack router.
def vllm_gauges(s: EngineStats) -> list[Series]:
    return [
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         s.num_running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         s.num_waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         s.kv_cache_usage),
        ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. "
         "DEPRECATED: Use vllm:kv_cache_usage_perc instead.", s.kv_cache_usage),
    ]


def vllm_counters(s: EngineStats) -> list[Series]:
    """Exposed with `_total` appended, as prometheus_client does for vLLM."""
    return [
        ("vllm:prefix_cache_queries",
         "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         s.prefix_cache_hits),
        ("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of "
         "queried tokens. DEPRECATED: Use vllm:prefix_cache_queries instead.",
         s.prefix_cache_queries),
        ("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached "
         "tokens. DEPRECATED: Use vllm:prefix_cache_hits instead.", s.prefix_cache_hits),
    ]


VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE_INDEX = "0"  # vLLM numbers its engine cores (data parallel); Plait has one


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What the `vllm:` series say about the engine besides its stats: the served model name
    (label `model_name`) and the KV cache's shape (`vllm:cache_config_info`). Built at scrape
    time by the app once the engine has loaded."""

    model_name: str
    block_size: int  # tokens per KV block
    num_gpu_blocks: int  # blocks in the pool (vLLM's name; on CPU too)
    cache_dtype: str
    enable_prefix_caching: bool

    def cache_config_labels(self) -> dict[str, str]:
        """Labels of `vllm:cache_config_info` (a gauge of 1): vLLM puts every CacheConfig
        field there as a string, plus `engine`; these are the ones Plait has. The picker
        reads `block_size` and `num_gpu_blocks` as integers."""
        return {"block_size": str(self.block_size), "cache_dtype": self.cache_dtype,
                "enable_prefix_caching": str(self.enable_prefix_caching),
                "num_gpu_blocks": str(self.num_gpu_blocks), "engine": VLLM_ENGINE_INDEX}


class EngineCollector(Collector):
    """Exports the engine's own stats at scrape time, as `plait_` names and (with an
    identity) as vLLM's; nothing while the engine is not loaded."""

    def __init__(self, stats: Callable[[], EngineStats | None],
                 identity: Callable[[], EngineIdentity | None] = lambda: None) -> None:
        self._stats = stats
        self._identity = identity

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        for name, doc, value in plait_gauges(stats):
            yield GaugeMetricFamily(name, doc, value=float(value))
        for name, doc, value in plait_counters(stats):
            yield CounterMetricFamily(name, doc, value=float(value))
        identity = self._identity()
        if identity is not None:
            yield from _vllm_families(stats, identity)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _vllm_families(stats: EngineStats, identity: EngineIdentity) -> Iterator[Metric]:
    """vLLM's series for one engine: its gauges and counters of `stats` (one scrape's
    snapshot) labelled with the served model name, and `vllm:cache_config_info`."""
    labels = [identity.model_name, VLLM_ENGINE_INDEX]
    for name, doc, value in vllm_gauges(stats):
        gauge = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
        gauge.add_metric(labels, float(value))
        yield gauge
    for name, doc, value in vllm_counters(stats):
        counter = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
        counter.add_metric(labels, float(value))
        yield counter
    yield from _spec_decode_families(stats, labels)
    info = identity.cache_config_labels()
    family = GaugeMetricFamily("vllm:cache_config_info",
                               "Information of the LLMEngine CacheConfig", labels=list(info))
    family.add_metric(list(info.values()), 1.0)
    yield family


def spec_decode_counters(s: EngineStats) -> list[Series]:
    """Speculative decoding's counters (vLLM's names, `_total` appended)."""
    return [
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
         s.spec_decode_num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
         s.spec_decode_num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
         s.spec_decode_num_accepted_tokens),
    ]


def _spec_decode_families(stats: EngineStats, labels: list[str]) -> Iterator[Metric]:
    """vLLM's spec_decode series, only when the engine speculates (as vLLM registers them
    only with a speculative config): the three counters and the accepted tokens per
    draft position (label `position`, 0 .. num_speculative_tokens - 1)."""
    if not stats.spec_decode_accepted_per_pos:
        return
    for name, doc, value in spec_decode_counters(stats):
        counter = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
        counter.add_metric(labels, float(value))
        yield counter
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.",
                                  labels=[*VLLM_LABELS, "position"])
    for position, value in enumerate(stats.spec_decode_accepted_per_pos):
        per_pos.add_metric([*labels, str(position)], float(value))
    yield per_pos


class ServerMetrics:
    """The app's registry plus the metrics the HTTP layer observes. `engine_stats` and
    `identity` are called at scrape time (None while the engine is not loaded)."""

    def __init__(self, engine_stats: Callable[[], EngineStats | None],
                 identity: Callable[[], EngineIdentity | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine_stats, identity))
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
