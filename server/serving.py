"""Run a `Generation` as an HTTP response, streaming or not, and abort it when the client
goes away.

Streaming: the first delta is awaited (up to one ping interval) before the response starts,
so an engine failure before the first byte is an ordinary error envelope; after that,
failures are in-stream error events. Non-streaming: the collection runs as a task next to
a watcher of `http.disconnect`; a disconnect cancels it and aborts the sub-requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.types import Receive

from plait.server.errors import server_error
from plait.server.generation import ChoiceState, Generation, GenerationError
from plait.server.sse import DONE, encode, error_event, sse_response

logger = logging.getLogger("plait.server")
T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; never seen by it

StreamBody = Callable[[Generation], AsyncIterator[bytes]]
BuildResponse = Callable[[Generation, list[ChoiceState]], dict[str, Any]]


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def serve_generation(request: Request, gen: Generation, *, stream: StreamBody | None,
                           build: BuildResponse) -> Response:
    """Run `gen` (`async with gen`) and answer with SSE (`stream`) or one JSON body (`build`).

    Leaving `gen` aborts its unfinished sub-requests; every path leaves it once. A JSON
    body, a refusal, an error or a disconnect leave it here. A stream takes the exit over
    (`pop_all`): it runs when the body ends (done, failed, cancelled by a disconnect) or,
    if the body never starts, after the response, whichever comes first.
    """
    ping = gen.state.settings.sse_ping_interval
    async with contextlib.AsyncExitStack() as scope:
        await scope.enter_async_context(gen)
        try:
            if stream is None:
                choices = await run_unless_disconnected(request.receive, gen.run_to_end())
                return JSONResponse(build(gen, choices))
            await run_unless_disconnected(request.receive, gen.first_ready(ping or None))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        owner = scope.pop_all()
    return sse_response(_owning(stream(gen), gen, owner), ping, BackgroundTask(owner.aclose))


async def _owning(body: AsyncIterator[bytes], gen: Generation,
                  owner: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """`body`, then leave `gen` however the stream ends (done, disconnect, cancel). An
    unexpected error while building the stream ends it the way clients expect: an error
    event, then [DONE] (the details go to the log only)."""
    try:
        async for frame in body:
            yield frame
    except Exception:
        logger.exception("request %s: the stream failed", gen.request_id)
        yield error_event(server_error().message)
        yield DONE
    finally:
        await owner.aclose()


def chunk_base(gen: Generation, object_name: str) -> dict[str, Any]:
    """The keys every chunk of a chat or completions stream starts with."""
    return {"id": gen.request_id, "object": object_name, "created": gen.created,
            "model": gen.state.model_name}


async def with_tail(chunks: AsyncIterator[bytes], gen: Generation, object_name: str,
                    include_usage: bool) -> AsyncIterator[bytes]:
    """A chat or completions stream: its choice `chunks`, then the tail both end with

        data: {"id":..,"object":<object_name>,..,"choices":[],"usage":{..}}  include_usage
        data: [DONE]

    or, when the generation fails after the stream started (`GenerationError`),

        data: {"error":{"message":..,"type":"server_error","param":null,"code":null}}
        data: [DONE]

    (Responses streams end with their own events: responses/stream.py.)"""
    try:
        async for frame in chunks:
            yield frame
    except GenerationError as exc:
        yield error_event(str(exc))
    else:
        if include_usage:
            yield encode({**chunk_base(gen, object_name), "choices": [], "usage": gen.usage()})
    yield DONE


async def run_unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise
    `ClientDisconnected`. Call after the request body has been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
