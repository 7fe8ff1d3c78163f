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


# Characters that Python's str.splitlines (and so httpx's `aiter_lines`) takes for line
# ends but JSON leaves raw: a token's text holding one would cut its event's line in two.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                "\u2029": "\\u2029"})


def event_json(payload: dict[str, Any]) -> str:
    """`payload` as the compact JSON of one event's `data:` line: UTF-8 as it is, except
    the characters a client's line splitter may break on, escaped (the same JSON value;
    control characters json.dumps escapes already)."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.translate(_LINE_BREAKING)


def encode(payload: dict[str, Any]) -> bytes:
    """One `data:` event holding `payload` as compact JSON (`event_json`)."""
    return b"data: " + event_json(payload).encode() + b"\n\n"


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
