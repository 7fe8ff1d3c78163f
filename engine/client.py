"""What the server holds of an engine, whichever way its core runs, and the core loop both
ways share.

    EngineClient            (event loop side; one per server)
      AsyncEngine           core in a thread of this process   (engine/async_engine.py)
      ProcessEngine         core in a child process            (engine/engine_process.py)

    add_request() -> RequestStream      one async stream of deltas per sub-request
    _send(command)                      subclass: hand a wire command to the core's loop
    _deliver(deltas, stats)             from any thread: stats now, deltas on the event loop
    _die(message)                       from any thread: unhealthy, every stream ends in error

`run_core_loop` is the loop around `EngineCore` that both the engine thread and the engine
process run: block for a command while idle, drain all pending commands between steps
without blocking, step, report.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVarTuple

from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core_api import Core, EngineStats
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams
from plait.engine.wire import (
    AbortCommand,
    AddBatchCommand,
    AddCommand,
    Command,
    ShutdownCommand,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Ts = TypeVarTuple("Ts")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class EngineLoadError(RuntimeError):
    """Loading failed where the core runs (the engine process). `str()` is already the one
    line to report, "Type: message" of the original error."""


class RequestStream:
    """Async iterator over one sub-request's deltas. Only the event loop thread touches it.

    A stream merges deltas its consumer has not read yet, so a slow reader costs memory in
    proportion to its text, never to the number of engine steps."""

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


class EngineClient:
    """The engine API of the server: `load()` (blocking, in a worker thread), `start(loop)`,
    `add_request` / `abort` (event loop thread), `stats()`, `shutdown()`.

    Invariants: every stream handed out gets exactly one final delta (the core's, or an
    error delta when the engine dies); `num_queued` counts sub-requests added and not yet
    finished; once `dead_error` is set it stays set and `add_request` raises
    `EngineDeadError`. `core` is the core when it lives in this process, else None.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core: Core | None = None
        self.dead_error: str | None = None
        self.num_queued = 0  # sub-requests sent to the engine but not yet finished
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = EngineStats()

    # ---------------------------------------------------------------- subclass contract
    def load(self) -> None:
        raise NotImplementedError

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        raise NotImplementedError

    @property
    def info(self) -> RuntimeInfo:
        raise NotImplementedError

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        raise NotImplementedError

    def _send(self, command: Command) -> None:
        """Hand `command` to the core's loop without blocking; called on the event loop."""
        raise NotImplementedError

    # ---------------------------------------------------------------- shared
    def stats(self) -> EngineStats:
        """The latest snapshot of `EngineCore.stats()`, taken after the core's last step."""
        return self._stats

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestStream:
        """Send one sub-request to the engine. Call on the event loop thread, with a
        request that passed `validate_request` (the server checks each prompt once before
        fan-out); the caller must not change `prompt_token_ids` or `params` afterwards."""
        return self.add_requests([(request_id, prompt_token_ids, params)])[0]

    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]]
                     ) -> list[RequestStream]:
        """`add_request` for several sub-requests in one command: the engine applies them
        all before its next step (one HTTP request's choices start together)."""
        if not self.healthy:
            raise EngineDeadError(self.dead_error or "the engine is not running")
        streams = []
        for request_id, _, _ in requests:
            stream = RequestStream(request_id)
            self._streams[request_id] = stream
            streams.append(stream)
        self.num_queued += len(requests)
        self._send(AddBatchCommand([AddCommand(*request) for request in requests]))
        return streams

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop a sub-request; its stream gets a final "abort" delta."""
        if request_id in self._streams:
            self._send(AbortCommand(request_id))

    def fail_all(self, message: str) -> int:
        """Event loop thread: end every live stream now with an "error" delta carrying
        `message`, and ask the engine to drop those requests (the server's drain ran out).
        The engine's own final deltas for them are ignored when they come. How many ended."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            if self.dead_error is None:
                self._send(AbortCommand(request_id))
            self._dispatch([RequestDelta(request_id, finish_reason="error", error=message)])
        return len(request_ids)

    def _deliver(self, deltas: list[RequestDelta], stats: EngineStats) -> None:
        """From any thread: publish `stats` now, then hand `deltas` to the event loop (stats
        first, so whoever reads a final delta sees counters that include it)."""
        self._stats = stats
        if deltas:
            self._call_on_loop(self._dispatch, deltas)

    def _die(self, message: str) -> None:
        """From any thread: the engine is gone for good; every live stream ends in error."""
        if self.dead_error is None:
            self.dead_error = message
        self._call_on_loop(self._fail_all)

    def _call_on_loop(self, fn: Callable[[*Ts], None], *args: *Ts) -> None:
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
        self.fail_all(self.dead_error or "the engine stopped")  # dead: nothing is sent


# ---------------------------------------------------------------- the core's side
Receive = Callable[[bool], Command | None]
Emit = Callable[[list[RequestDelta], EngineStats], None]


def run_core_loop(core: Core, receive: Receive, emit: Emit) -> None:
    """Drive `core` until a `ShutdownCommand` arrives.

    `receive(block)` returns the next command; with block=False it returns None when none
    is pending, with block=True it waits for one (the loop blocks only while the core has
    nothing it can step), or returns None after a timeout of its choice. `emit(deltas,
    stats)` gets each iteration's deltas (maybe none) and the core's stats after it.
    Exceptions from the core propagate: the caller decides what a dead loop means.

    The loop alone keeps `stalled`: set by a step that could compute nothing, cleared by
    any command (a new or a freed request may make progress possible again). While idle
    (stalled, or nothing unfinished) it gives the core's `idle_work` one slice at a time,
    looking for a command between slices, and blocks only once the core says none is left
    (asked again after any command or step).
    """
    stalled, more_idle_work = False, True
    while True:
        idle = stalled or not core.has_unfinished()
        if idle and more_idle_work:
            more_idle_work = core.idle_work()
        deltas: list[RequestDelta] = []
        command = receive(idle and not more_idle_work)
        if command is None and idle and more_idle_work:
            continue  # nothing came: the next slice (no step can run, nothing to emit)
        while command is not None:
            if isinstance(command, ShutdownCommand):
                return
            stalled, more_idle_work = False, True
            batch = command.requests if isinstance(command, AddBatchCommand) else [command]
            for one in batch:
                delta = apply_command(core, one)
                if delta is not None:
                    deltas.append(delta)
            command = receive(False)
        if core.has_unfinished():
            result = core.step()
            deltas.extend(result.deltas)
            stalled, more_idle_work = result.stalled, True
        emit(deltas, core.stats())


def apply_command(core: Core, command: AddCommand | AbortCommand) -> RequestDelta | None:
    """Apply one add/abort to `core`; a refused add becomes that request's error delta."""
    if isinstance(command, AbortCommand):
        return core.abort(command.request_id)
    try:
        core.add_request(command.request_id, command.prompt_token_ids, command.params)
    except ValueError as exc:  # a duplicate id (requests are validated before they come)
        return RequestDelta(command.request_id, finish_reason="error", error=str(exc))
    return None
