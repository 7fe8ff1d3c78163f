"""Run the app under uvicorn for `plait serve`: logging, drain on SIGTERM, exit codes.

SIGTERM / Ctrl-C starts the drain, which load balancers and the kubelet can follow:

    t = 0        /health (readiness) answers 503, new API requests get 503; the listener
                 stays open, so probes get an answer, not a refused connection; /live stays
                 200; running requests (streams included) go on
    last ends    the server stops: listener closed, engine shut down, exit 0
    t = drain    (`drain_timeout`) if requests are still running, each live engine request
                 ends with an error ("the server is shutting down"): a stream gets an error
                 event and [DONE], a non-streaming request a 500 envelope; they get up to
                 `CUT_GRACE_S` to send it, then the server stops as above

A second signal ends the drain at once (the cut above). A model that fails to load stops
the server with exit 1. HTTP is uvicorn's h11 protocol with envelopes and a header timeout
(http_protocol.py). A supervisor's kill timeout must exceed `drain_timeout` + CUT_GRACE_S +
the engine's exit (docs/operations.md: `docker stop -t`, terminationGracePeriodSeconds).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus

from plait.server import offload
from plait.server.app import create_app
from plait.server.http_protocol import EnvelopeH11Protocol
from plait.server.settings import ServerSettings
from plait.server.state import ServerState

logger = logging.getLogger("plait.server")


# After the drain time, how long cut requests get to send their final error and end.
CUT_GRACE_S = 3.0
# uvicorn's own wait for connections after the drain (only stragglers are left then).
CLOSE_TIMEOUT_S = 2.0
DRAIN_MESSAGE = "The server is shutting down: this request was still running when the " \
    "shutdown's drain time ran out."


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above: a signal marks the app as draining and the
    server keeps listening until no request is left, or the drain time runs out and the
    rest are cut. `server_state.tasks` (one per request being served) is what "running"
    means; idle keep-alive connections do not count."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.plait_state = state
        self.drain_deadline: float | None = None  # monotonic; set by the first signal
        self.cut_deadline: float | None = None  # set when the drain time ran out
        # sse-starlette would otherwise end every stream the moment a signal arrives.
        AppStatus.disable_automatic_graceful_drain()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """From the signal handler: start the drain, or end it now on a second signal."""
        self._captured_signals.append(sig)
        now = time.monotonic()
        if self.drain_deadline is None:
            logger.info("received signal %d: draining for up to %.0f s (/health answers "
                        "503; a second signal ends the drain)", sig,
                        self.plait_state.settings.drain_timeout)
            self.plait_state.draining = True
            self.drain_deadline = now + self.plait_state.settings.drain_timeout
        else:
            self.drain_deadline = min(self.drain_deadline, now)
            if sig == signal.SIGINT and self.cut_deadline is not None:
                self.force_exit = True  # a third Ctrl-C: uvicorn's own force quit

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: True once the server should stop listening and shut down."""
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            return False
        running = len(self.server_state.tasks)
        if running == 0:
            logger.info("drained: no request left")
            return True
        now = time.monotonic()
        if self.cut_deadline is None and now >= self.drain_deadline:
            cut = self.plait_state.engine.fail_all(DRAIN_MESSAGE)
            logger.warning("drain time over: %d request(s) still running, %d engine "
                           "sub-request(s) ended with an error", running, cut)
            self.cut_deadline = now + CUT_GRACE_S
        return self.cut_deadline is not None and now >= self.cut_deadline


def torch_build() -> str:
    """"torch 2.13.0+cpu (CPU build)" or "... (CUDA 12.8 build)", read from torch's
    version.py without importing torch (this process stays torch-free); "torch not
    installed" when it is not."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "torch not installed"
    text = (Path(spec.origin).parent / "version.py").read_text()
    found = dict(re.findall(r"^(__version__|cuda|hip)\b[^=]*= *'?([^'\n]*)'?$", text, re.M))
    version = found.get("__version__", "?")
    for name, label in (("cuda", "CUDA"), ("hip", "ROCm")):
        if found.get(name, "None") != "None":
            return f"torch {version} ({label} {found[name]} build)"
    return f"torch {version} (CPU build)"


def run_server(settings: ServerSettings) -> int:
    """Serve until a signal (exit 0) or a failed model load (exit 1)."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("%s", torch_build())
    exit_code = 0
    server: DrainingServer | None = None

    def on_load_error(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_error=on_load_error)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level,
                            http=EnvelopeH11Protocol.with_header_timeout(settings.header_timeout),
                            timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=CLOSE_TIMEOUT_S)  # type: ignore[arg-type]
    server = DrainingServer(config, app.state.plait)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op SIGTERM handler
    # makes that a clean exit 0 instead of death by signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except KeyboardInterrupt:
        exit_code = 130 if exit_code == 0 else exit_code
    else:
        if exit_code == 0 and not server.started:
            exit_code = 1  # e.g. the port was taken
    _exit_now_if_work_is_abandoned(exit_code)
    return exit_code


def _exit_now_if_work_is_abandoned(exit_code: int) -> None:
    """Interpreter shutdown would wait for a worker still inside a tokenizer call (it
    cannot be interrupted) long after the drain timeout: exit at once instead."""
    if offload.POOL.num_running == 0:
        return
    logger.warning("exiting with %d offloaded call(s) unfinished (drain timeout over)",
                   offload.POOL.num_running)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
