"""Interleave the delta streams of one request's sub-requests, in arrival order.

    stream 0: d0a ─────── d0b ── d0c(fin)
    stream 1: ──── d1a ──────────────── d1b(fin)
    merged:   (0,d0a) (1,d1a) (0,d0b) (0,d0c) (1,d1b)   then StopAsyncIteration

One waiter task per unfinished stream awaits that stream's next delta. At most one delta per
stream is ever held here; while the consumer is slow, newer output keeps coalescing inside
the engine's `RequestStream` (a delta that carries several tokens), so memory is bounded by
the text produced, never by the number of engine steps. One stream's deltas are yielded in
order; deltas that became ready in the same event-loop turn are yielded by stream key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K")
D = TypeVar("D")


class StreamMerger(Generic[K, D]):
    """Async iterator of `(key, item)` over several async iterators until all are exhausted.

    `close()` cancels the waiters (call it when the consumer stops early); the underlying
    streams are left as they are (aborting them is the caller's job).
    """

    def __init__(self, streams: Mapping[K, AsyncIterator[D]]) -> None:
        self._streams = dict(streams)
        self._waiters: dict[K, asyncio.Task[D]] = {}
        self._ready: list[tuple[K, D]] = []
        self._closed = False

    def __aiter__(self) -> StreamMerger[K, D]:
        return self

    async def __anext__(self) -> tuple[K, D]:
        while not self._ready:
            if self._closed or not self._streams:
                raise StopAsyncIteration
            await self._wait(None)
        return self._ready.pop(0)

    async def wait_ready(self, timeout: float | None) -> bool:
        """Wait until `__anext__` would not block (an item or the end); False on timeout."""
        if not self._ready and self._streams and not self._closed:
            await self._wait(timeout)
        return bool(self._ready) or not self._streams or self._closed

    def close(self) -> None:
        self._closed = True
        for task in self._waiters.values():
            task.cancel()
        self._waiters.clear()
        self._streams.clear()

    async def _wait(self, timeout: float | None) -> None:
        for key, stream in self._streams.items():
            if key not in self._waiters:
                self._waiters[key] = asyncio.ensure_future(anext(stream))
        done, _ = await asyncio.wait(self._waiters.values(), timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        finished = [key for key, task in self._waiters.items() if task in done]
        for key in sorted(finished, key=_sort_key):
            task = self._waiters.pop(key)
            try:
                self._ready.append((key, task.result()))
            except StopAsyncIteration:
                del self._streams[key]


def _sort_key(key: object) -> int | str:
    return key if isinstance(key, (int, str)) else repr(key)
