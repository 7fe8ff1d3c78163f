"""`create_app(settings)`: the FastAPI application around one engine: a `ProcessEngine`
(the core in a child process) unless `settings.engine_process` is off, then an `AsyncEngine`
(the core in a thread of this process). Only the second imports torch into this process:
the default front end stays torch-free (tests/server/test_server_torch_free.py).

The lifespan only *starts* loading the model (in a background thread) and returns, so the
server socket listens while the model loads and /health answers 503 until the engine is
ready. Middleware, outermost first: HEAD as GET, x-request-id (and the 500 envelope), CORS,
the body size limit (413), routes (the playground at /ui when `settings.ui_enabled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

import plait
from plait.engine import EngineClient, EngineLoadError, ProcessEngine, TokenTextTable
from plait.server import chat, completions, faults, misc, render
from plait.server.auth import require_api_key
from plait.server.errors import install_error_handlers
from plait.server.metrics import EngineIdentity, ServerMetrics
from plait.server.middleware import (
    BodyLimitMiddleware,
    HeadAsGetMiddleware,
    RequestIdMiddleware,
)
from plait.server.openapi import install_openapi
from plait.server.responses import route as responses_route
from plait.server.responses.store import ResponseStore
from plait.server.settings import ServerSettings
from plait.server.state import ServerState
from plait.server.ui import ui_router

logger = logging.getLogger("plait.server")
T = TypeVar("T")

LoadErrorHook = Callable[[str], None]


def create_app(settings: ServerSettings | None = None, engine: EngineClient | None = None,
               on_load_error: LoadErrorHook | None = None) -> FastAPI:
    """Build the app. `engine` defaults to `default_engine(settings)`; it is loaded and
    started by the lifespan (not here) and shut down when the app stops. `on_load_error`
    is called with a one-line message if loading fails (the CLI exits then)."""
    settings = settings or ServerSettings()
    engine = engine or default_engine(settings)
    metrics = ServerMetrics(lambda: engine.stats() if engine.ready else None,
                            lambda: _identity(state))
    state = ServerState(settings, engine, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, on_load_error))
        try:
            yield
        finally:
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Plait", version=plait.__version__, lifespan=lifespan)
    app.state.plait = state
    app.state.responses = ResponseStore(settings.responses_store_size, settings.responses_ttl)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods),
                       allow_headers=list(settings.allowed_headers),
                       expose_headers=["x-request-id"])
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HeadAsGetMiddleware)
    app.include_router(misc.open_router)
    if settings.ui_enabled:
        app.include_router(ui_router())  # the playground: open, the page sends the key
    guarded = [Depends(require_api_key)]
    for router in (chat.router, completions.router, render.router, responses_route.router,
                   misc.router):
        app.include_router(router, dependencies=guarded)
    install_openapi(app)
    return app


def _identity(state: ServerState) -> EngineIdentity | None:
    """The served model and KV cache shape for the `vllm:` metrics, once loaded."""
    engine = state.engine
    if not engine.ready:
        return None
    info = engine.info
    return EngineIdentity(state.model_name, info.block_size, info.num_kv_blocks, info.dtype,
                          engine.config.enable_prefix_caching)


def default_engine(settings: ServerSettings) -> EngineClient:
    """The engine `settings` ask for: the core in its own process, or in a thread here.
    The in-thread engine (and with it torch) is imported only when it is chosen."""
    if settings.engine_process:
        return ProcessEngine(settings.engine, fault_injection=settings.fault_injection)
    from plait.engine import AsyncEngine  # torch: only for the in-thread engine

    return AsyncEngine(settings.engine)


async def _load(state: ServerState, on_error: LoadErrorHook | None) -> None:
    """Load the model off the event loop, then start the engine on this loop."""
    engine = state.engine
    try:
        if not engine.ready:
            logger.info("loading the model (the server answers /health with 503 until ready)")
            await _in_daemon_thread(engine.load)
            if state.settings.fault_injection:
                faults.install(engine)
            engine.start(asyncio.get_running_loop())
        state.token_text = TokenTextTable(engine.tokenizer)
    except Exception as exc:  # one line, no traceback: usually a bad model path
        is_one_line = isinstance(exc, EngineLoadError)  # already "Type: message"
        state.load_error = str(exc) if is_one_line else f"{type(exc).__name__}: {exc}"
        logger.error("cannot load the model: %s", state.load_error)
        if on_error is not None:
            on_error(state.load_error)
        return
    info = engine.info
    logger.info("ready: serving %s as %r (device %s, dtype %s, %d KV blocks, context %d)",
                info.model_name, state.model_name, info.device, info.dtype,
                info.num_kv_blocks, info.max_model_len)


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """Like `asyncio.to_thread`, but a daemon thread: Ctrl-C during a long load exits at
    once instead of waiting for the load to finish."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(_settle, future, result, error)

    threading.Thread(target=run, name="plait-load", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
