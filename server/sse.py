"""Server-sent events: framing, the [DONE] terminator, in-stream errors, the response.

Frames are `data: <json>\\n\\n`; idle streams get `: ping\\n\\n` comments every
`ping_interval` seconds (sse-starlette's ping task). sse-starlette also watches for the client
disconnecting and then cancels the body iterator, whose `finally` aborts the engine work.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

DONE = b"data: [DONE]\n\n"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode(payload: dict[str, Any]) -> bytes:
    """One `data:` event holding `payload` as compact JSON."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode() + b"\n\n"


def error_event(message: str) -> bytes:
    """An engine failure after the stream started: the SDK raises on an `error` key."""
    return encode({"error": {"message": message, "type": "server_error", "param": None,
                             "code": None}})


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep="\n")


def sse_response(body: AsyncIterator[bytes], ping_interval: float,
                 background: BackgroundTask | None = None) -> EventSourceResponse:
    """A `text/event-stream` response over pre-encoded frames, never buffered by proxies.
    `background` runs once the response is over, even if the body never started."""
    return EventSourceResponse(body, headers=STREAM_HEADERS, ping=ping_interval, sep="\n",
                               ping_message_factory=_ping, background=background)
