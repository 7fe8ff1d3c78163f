"""A run's numbers: throughput over the run and latency distributions over its successful
requests. Latencies are per choice where a request has n > 1:

    TTFT  send -> the choice's first content chunk
    ITL   gap between consecutive content chunks of one choice
    TPOT  (last chunk - first chunk) / (the choice's tokens - 1), tokens from usage shared
          out over the choices by their chunks (chunks alone without usage)
    E2E   send -> end of the stream, per request

Throughput divides by the run's duration (first send to last stream end). Percentiles are
nearest-rank, so p50 <= p90 <= p99 always holds and every value is a measured one.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

from plait.bench.runner import RequestRecord, RunResult

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1) of `values`, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, mean and percentiles of one latency, in milliseconds (None: no sample)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution:
        ms = [v * 1000 for v in values]
        mean = sum(ms) / len(ms) if ms else None
        return cls(len(ms), mean, *(percentile(ms, p / 100) for p in PERCENTILES))


@dataclass(frozen=True, slots=True)
class Summary:
    """What `plait bench` prints and keeps under "summary" in its JSON file. Token totals
    count successful requests only; `prompt_tokens` is None when no server usage came."""

    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # error message -> how many requests failed with it
    duration_s: float
    request_throughput: float  # successful requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    prompt_tokens: int | None
    output_tokens: int
    requests_with_usage: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution


def _choice_latencies(record: RequestRecord) -> tuple[list[float], list[float], list[float]]:
    """(TTFTs, TPOTs, ITLs) in seconds of every choice of one request."""
    result = record.result
    ttfts, tpots, itls = [], [], []
    total_chunks = result.num_chunks
    for times in result.token_times.values():
        ttfts.append(times[0])
        itls += [b - a for a, b in itertools.pairwise(times)]
        tokens = (len(times) if result.completion_tokens is None
                  else result.completion_tokens * len(times) / total_chunks)
        if tokens > 1:
            tpots.append((times[-1] - times[0]) / (tokens - 1))
    return ttfts, tpots, itls


@dataclass(slots=True)
class Samples:
    """Every latency sample, in seconds, of a run's successful requests."""

    ttft: list[float]
    tpot: list[float]
    itl: list[float]
    e2e: list[float]


def latency_samples(records: list[RequestRecord]) -> Samples:
    samples = Samples([], [], [], [])
    for record in records:
        if record.result.error is not None:
            continue
        ttft, tpot, itl = _choice_latencies(record)
        samples.ttft += ttft
        samples.tpot += tpot
        samples.itl += itl
        samples.e2e.append(record.result.e2e_s or 0.0)
    return samples


def summarize(run: RunResult) -> Summary:
    ok = [r for r in run.records if r.result.error is None]
    errors = Counter(r.result.error for r in run.records if r.result.error is not None)
    samples = latency_samples(ok)
    with_usage = [r for r in ok if r.result.prompt_tokens is not None]
    prompt = sum(r.result.prompt_tokens or 0 for r in with_usage) if with_usage else None
    output = sum(r.result.output_tokens for r in ok)
    duration = run.duration_s

    def rate(amount: float) -> float:
        return amount / duration if duration > 0 else 0.0

    return Summary(
        num_requests=len(run.records), completed=len(ok), failed=len(run.records) - len(ok),
        errors=dict(errors.most_common()), duration_s=duration,
        request_throughput=rate(len(ok)), output_throughput=rate(output),
        total_token_throughput=rate(output + (prompt or 0)), prompt_tokens=prompt,
        output_tokens=output, requests_with_usage=len(with_usage),
        ttft_ms=Distribution.of_seconds(samples.ttft),
        tpot_ms=Distribution.of_seconds(samples.tpot),
        itl_ms=Distribution.of_seconds(samples.itl), e2e_ms=Distribution.of_seconds(samples.e2e))
