"""Run the app under uvicorn for `plait serve`: logging, drain on SIGTERM, exit codes.

SIGTERM / Ctrl-C: /health turns 503 at once, the listening socket closes, in-flight
requests (streams included) get up to `drain_timeout` seconds to finish, then the engine
stops and the process exits 0. A model that fails to load stops the server with exit 1.
HTTP is uvicorn's h11 protocol with envelopes and a header timeout (http_protocol.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus

from plait.server import offload
from plait.server.app import create_app
from plait.server.http_protocol import EnvelopeH11Protocol
from plait.server.settings import ServerSettings
from plait.server.state import ServerState

logger = logging.getLogger("plait.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's server that marks the app as draining when asked to exit, and lets SSE
    streams finish (uvicorn cancels what is left after `timeout_graceful_shutdown`)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.plait_state = state
        # sse-starlette would otherwise end every stream the moment a signal arrives.
        AppStatus.disable_automatic_graceful_drain()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.plait_state.draining:
            logger.info("received signal %d: draining for up to %.0f s",
                        sig, self.plait_state.settings.drain_timeout)
        self.plait_state.draining = True
        super().handle_exit(sig, frame)


def run_server(settings: ServerSettings) -> int:
    """Serve until a signal (exit 0) or a failed model load (exit 1)."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
                            timeout_graceful_shutdown=settings.drain_timeout)  # type: ignore[arg-type]
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
