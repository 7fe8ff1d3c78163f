"""Async front of the engine: the core loop runs in its own thread, asyncio code talks to it
through a command queue and gets each sub-request's deltas as an async stream.

    event loop thread                      engine thread
    add_request() --(queue)-->            core.add_request()
    abort()       --(queue)-->            core.abort()
    RequestStream <--call_soon_threadsafe-- core.step() deltas

A stream merges deltas its consumer has not read yet, so a slow reader costs memory in
proportion to its text, never to the number of engine steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core import EngineCore
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams
from plait.engine.scheduler import check_prompt_fits

logger = logging.getLogger("plait.engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestStream:
    """Async iterator over one sub-request's deltas. Only the event loop thread touches it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: RequestDelta | None = None
        self._event = asyncio.Event()
        self._done = False

    def put(self, delta: RequestDelta) -> None:
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        self._event.set()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        while self._pending is None:
            self._event.clear()
            await self._event.wait()
        delta, self._pending = self._pending, None
        self._event.clear()
        self._done = delta.finished
        return delta


class AsyncEngine:
    """Loads the model (`load`, blocking: call it in a worker thread), then serves."""

    def __init__(self, config: EngineConfig,
                 core_factory: Callable[[EngineConfig], EngineCore] = EngineCore) -> None:
        self.config = config
        self._core_factory = core_factory
        self.core: EngineCore | None = None
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats: dict[str, Any] = {}
        self.dead_error: str | None = None
        self.num_queued = 0  # sub-requests sent to the engine thread but not yet finished

    # ---------------------------------------------------------------- lifecycle
    def load(self) -> None:
        self.core = self._core_factory(self.config)
        self._stats = self.core.stats()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; deltas are delivered on `loop`."""
        if self.core is None:
            raise RuntimeError("load() the engine before start()")
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="plait-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.core is not None and self._thread is not None

    @property
    def healthy(self) -> bool:
        return (self.ready and self.dead_error is None and self._thread is not None
                and self._thread.is_alive())

    @property
    def info(self) -> RuntimeInfo:
        assert self.core is not None
        return self.core.info

    @property
    def tokenizer(self) -> Any:
        assert self.core is not None
        return self.core.tokenizer

    def stats(self) -> dict[str, Any]:
        """The latest snapshot taken by the engine thread after a step."""
        return dict(self._stats)

    # ---------------------------------------------------------------- requests
    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise `RequestRejected` if a prompt of this length can never be served."""
        info = self.info
        check_prompt_fits(num_prompt_tokens, info.max_model_len, info.num_kv_blocks,
                          self.config.block_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestStream:
        """Send one sub-request to the engine. Call on the event loop thread."""
        if not self.healthy:
            raise EngineDeadError(self.dead_error or "the engine is not running")
        self.check_prompt(len(prompt_token_ids))
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self.num_queued += 1
        self._commands.put(("add", (request_id, prompt_token_ids, params)))
        return stream

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._commands.put(("abort", request_id))

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        core = self.core
        assert core is not None
        try:
            while not self._stop.is_set():
                idle = not core.has_unfinished() or core.stalled
                deltas = self._apply_commands(core, block=idle)
                if core.has_unfinished():
                    deltas.extend(core.step())
                self._stats = core.stats()
                if deltas:
                    self._deliver(deltas)
        except BaseException as exc:  # the loop itself died: fail everything, turn unhealthy
            logger.exception("engine loop died")
            self.dead_error = f"engine loop died: {type(exc).__name__}"
            self._call_on_loop(self._fail_all)

    def _apply_commands(self, core: EngineCore, block: bool) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return deltas
        while True:
            kind, arg = command
            if kind == "add":
                request_id, token_ids, params = arg
                core.stalled = False
                try:
                    core.add_request(request_id, token_ids, params)
                except ValueError as exc:  # RequestRejected or bad params
                    deltas.append(RequestDelta(request_id, finish_reason="error", error=str(exc)))
            elif kind == "abort":
                core.stalled = False
                delta = core.abort(arg)
                if delta is not None:
                    deltas.append(delta)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return deltas

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        self._call_on_loop(self._dispatch, deltas)

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                self._loop.call_soon_threadsafe(fn, *args)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            stream.put(delta)
            if delta.finished:
                del self._streams[delta.request_id]
                self.num_queued -= 1

    def _fail_all(self) -> None:
        message = self.dead_error or "the engine stopped"
        for request_id in list(self._streams):
            self._dispatch([RequestDelta(request_id, finish_reason="error", error=message)])
