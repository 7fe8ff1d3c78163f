"""Send a run's requests: Poisson arrivals at --request-rate, at most --concurrency in
flight, a progress bar over finished requests.

    arrival i = sum of i exponential gaps of mean 1/rate   (rate inf: every arrival at 0)
    send i    = max(arrival i, a concurrency slot frees)    -> RequestRecord.start_s

All times are seconds from the run's start (the first arrival).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.bench.client import StreamResult, stream_request

if TYPE_CHECKING:
    import httpx


@dataclass(slots=True)
class RequestRecord:
    """One request of a run: when it was sent (seconds from the run's start) and what came
    back (token times in its `result` are seconds from that send)."""

    index: int
    start_s: float
    result: StreamResult


@dataclass(slots=True)
class RunResult:
    """Every request in arrival order, and the run's duration (first send to last end)."""

    records: list[RequestRecord]
    duration_s: float


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival offsets in seconds (all 0 when `rate` is inf)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run_requests(client: httpx.AsyncClient, path: str, bodies: list[dict[str, Any]],
                       rate: float, concurrency: int | None, seed: int,
                       progress: bool) -> RunResult:
    """Send every body to `path` as scheduled; server errors end up in the records."""
    from tqdm.auto import tqdm

    arrivals = arrival_times(len(bodies), rate, seed)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(bodies), disable=not progress, unit="req", desc="plait bench")
    begin = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        delay = arrivals[index] - (time.perf_counter() - begin)
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        try:
            start = time.perf_counter() - begin
            result = await stream_request(client, path, bodies[index])
        finally:
            if slots is not None:
                slots.release()
        bar.update(1)
        return RequestRecord(index, start, result)

    try:
        records = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    finally:
        bar.close()
    end = max((r.start_s + (r.result.e2e_s or 0.0) for r in records), default=0.0)
    first = min((r.start_s for r in records), default=0.0)
    return RunResult(list(records), end - first)
