"""The in-thread engine: `EngineCore` runs in a thread of the server process
(`plait serve --no-engine-process`, the offline tests' scripted cores). `plait serve` runs
the core in its own process instead (`ProcessEngine`, engine/engine_process.py); both share
the `EngineClient` front and the core loop (engine/client.py).

    event loop thread                      engine thread (run_core_loop)
    add_request() --(queue)-->            core.add_request()
    abort()       --(queue)-->            core.abort()
    RequestStream <--call_soon_threadsafe-- core.step() deltas

Here the core shares the GIL with uvicorn, JSON and SSE: simpler to debug and test, slower
under load. In both modes detokenization and stop strings run in the core, so a matched stop
string frees the request's blocks in the same step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from plait.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineLoadError,
    RequestStream,
    run_core_loop,
)
from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core import EngineCore
from plait.engine.core_api import Core
from plait.engine.wire import Command, ShutdownCommand

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["AsyncEngine", "EngineDeadError", "EngineLoadError", "RequestStream"]

logger = logging.getLogger("plait.engine")

IDLE_WAKE_S = 0.5


class AsyncEngine(EngineClient):
    """Loads the model (`load`, blocking: call it in a worker thread), then serves from a
    daemon thread. `core_factory` builds the core (tests pass a scripted one)."""

    def __init__(self, config: EngineConfig,
                 core_factory: Callable[[EngineConfig], Core] = EngineCore) -> None:
        super().__init__(config)
        self._core_factory = core_factory
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

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
        """Stop the engine thread after its current step (requests still live are dropped)."""
        self._commands.put(ShutdownCommand())
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
    def tokenizer(self) -> PreTrainedTokenizerBase:
        assert self.core is not None
        return self.core.tokenizer

    # ---------------------------------------------------------------- engine thread
    def _send(self, command: Command) -> None:
        self._commands.put(command)

    def _receive(self, block: bool) -> Command | None:
        # An idle loop still wakes every IDLE_WAKE_S to refresh its stats (and a core that
        # fails there, like a scripted one in tests, kills the loop as a step would).
        try:
            return self._commands.get(timeout=IDLE_WAKE_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        core = self.core
        assert core is not None, "start() checked it"
        try:
            run_core_loop(core, self._receive, self._deliver)
        except BaseException as exc:  # the loop itself died: fail everything, turn unhealthy
            logger.exception("engine loop died")
            self._die(f"engine loop died: {type(exc).__name__}")
        finally:
            core.close()  # the KV events publisher's sockets
