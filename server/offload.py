"""Heavy per-request work (tokenizing, chat templates, detokenizing, JSON parsing of large
bodies) runs here, off the event loop, so that /health and every other client keep being
answered while one request brings megabytes of text.

    await offload(fn, *args, size=len(text))   small inputs: inline (no thread hop)
                                               large ones: on a worker thread

The workers are daemon threads: a SIGTERM during a long tokenization ends the process once
the drain timeout is over instead of waiting for the work (a cancelled request's queued
work is skipped; work already running cannot be interrupted: serve.py exits without
waiting for it, since interpreter shutdown would wait for a thread inside the tokenizer).
The fast tokenizers release the GIL while encoding, so the loop stays responsive; decoding
and JSON parsing hold it, which is why request sizes are bounded before they get here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, TypeVarTuple

from fastapi.responses import Response

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

INLINE_MAX_SIZE = 64 * 1024  # characters (or bytes, or tokens) done inline: well under 10 ms
NUM_WORKERS = max(1, min(4, os.cpu_count() or 1))

_Job = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop,
             "asyncio.Future[Any]"]


class WorkerPool:
    """A fixed set of daemon threads, started on first use; `run` awaits one call."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.num_running = 0  # calls in progress on a worker

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._start()
        self._jobs.put((fn, args, loop, future))
        return await future

    def _start(self) -> None:
        with self._lock:
            while len(self._threads) < self.num_workers:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"plait-offload-{len(self._threads)}")
                thread.start()
                self._threads.append(thread)

    def _work(self) -> None:
        while True:
            fn, args, loop, future = self._jobs.get()
            if future.cancelled():  # its request went away while it waited
                continue
            result, error = None, None
            with self._lock:
                self.num_running += 1
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting request
                error = exc
            finally:
                with self._lock:
                    self.num_running -= 1
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


POOL = WorkerPool(NUM_WORKERS)


async def offload(fn: Callable[[*Ts], T], *args: *Ts, size: int) -> T:
    """`fn(*args)`, inline when `size` (the input's length) is small, else on a worker."""
    if size <= INLINE_MAX_SIZE:
        return fn(*args)
    return await POOL.run(fn, *args)


async def json_response(content: Any, size: int) -> Response:
    """`content` as a compact JSON response, encoded off the event loop when `size` (its
    number of token ids, say) is large: a 10 MB prompt is millions of ids."""
    return Response(await offload(_compact_json, content, size=size),
                    media_type="application/json")


def _compact_json(content: Any) -> bytes:
    return json.dumps(content, separators=(",", ":")).encode()
