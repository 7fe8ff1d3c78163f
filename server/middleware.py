"""ASGI middleware. Outermost: HEAD served as GET, then an `x-request-id` on every response and
a 500 envelope for any exception that escapes the app before the response started.
Innermost: the body size limit."""

from __future__ import annotations

import json
import logging
import re
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plait.server.errors import APIError, error_response, server_error

logger = logging.getLogger("plait.server")

# A client's id is echoed only if it is short, printable ASCII without spaces.
_CLIENT_ID = re.compile(r"^[\x21-\x7e]{1,200}$")


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Stores the request id in `scope["state"]["request_id"]` and echoes it as `x-request-id`.

    The id is the client's `x-request-id` when it sent a sane one, else a fresh uuid4 hex.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _client_id(scope) or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s failed", request_id)
            if started:
                raise
            body = json.dumps(server_error().body()).encode()
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()), header]})
            await send({"type": "http.response.body", "body": body})


def _client_id(scope: Scope) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"x-request-id":
            text = value.decode("latin-1")
            return text if _CLIENT_ID.match(text) else None
    return None


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body crosses the limit; FastAPI re-raises
    HTTPExceptions met while reading a body, and the error handlers turn it into a 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, too_large_message(max_bytes))


def too_large_message(max_bytes: int) -> str:
    return (f"The request body is too large: the limit is {max_bytes} bytes "
            "(--max-request-bytes).")


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: at once when Content-Length says so (nothing
    is read), else as soon as a chunked body crosses the limit while the app reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            error = APIError(413, too_large_message(self.max_bytes), code="request_too_large")
            await error_response(error)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class HeadAsGetMiddleware:
    """HEAD works on every GET route (/health, /v1/models, ...): the app sees a GET, and the
    server drops the body because its own scope still says HEAD."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)
