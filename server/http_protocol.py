"""uvicorn's h11 HTTP protocol with Plait's answers for what never reaches the app.

* A request the HTTP parser refuses (a malformed request line or header, a bad chunked
  body) gets the OpenAI envelope with an `x-request-id`, not uvicorn's plain-text 400; a
  request head still incomplete after `MAX_HEAD_BYTES` gets a 431 envelope.
* Header timeout: a connection must finish each request head within `header_timeout`
  seconds of connecting (or of its previous response); one that sent part of a head is
  answered 408 and closed, one that sent nothing is closed (slowloris, idle sockets).
  Idle keep-alive connections are closed by uvicorn's `timeout_keep_alive`.

The app is never called for these, so the responses are written here, as raw bytes (the
h11 state machine refuses to send a response to a request it never parsed).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from plait.server.errors import error_body
from plait.server.middleware import new_request_id

MAX_HEAD_BYTES = 16 * 1024  # h11's limit on an incomplete event (uvicorn's default)
MALFORMED_MESSAGE = "Invalid HTTP request: the server could not parse it."
HEAD_TOO_LARGE_MESSAGE = (f"The request head (request line and headers) is larger than "
                          f"{MAX_HEAD_BYTES} bytes.")


def raw_error_response(status: int, reason: str, message: str, code: str | None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = json.dumps(error_body(message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {new_request_id()}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class EnvelopeH11Protocol(H11Protocol):
    """See the module docstring. `header_timeout` is set by `with_header_timeout`."""

    header_timeout: float = 10.0

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[EnvelopeH11Protocol]:
        return type("PlaitH11Protocol", (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0  # bytes of a request head still being received
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiting_for_head = self.conn.their_state is h11.IDLE
        if waiting_for_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if waiting_for_head and self.conn.their_state is not h11.IDLE:
            self._head_bytes = 0
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._head_bytes = 0
            self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        if self._head_bytes > MAX_HEAD_BYTES:
            response = raw_error_response(431, "Request Header Fields Too Large",
                                          HEAD_TOO_LARGE_MESSAGE, "request_header_too_large")
        else:
            response = raw_error_response(400, "Bad Request", MALFORMED_MESSAGE,
                                          "invalid_http_request")
        self._close_with(response)

    # ---------------------------------------------------------------- header timeout
    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        # (getattr: the timer exists only once connection_made has run)
        timer: asyncio.TimerHandle | None = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request is being served: its head arrived in time
        if self.cycle is not None and not self.cycle.response_complete:
            return
        if self._head_bytes == 0:
            self.transport.close()
            return
        self.logger.warning("closing a connection that did not send its request head "
                            "within %.0f s", self.header_timeout)
        self._close_with(raw_error_response(
            408, "Request Timeout", f"The request head did not arrive within "
            f"{self.header_timeout:g} seconds.", "request_timeout"))

    def _close_with(self, response: bytes) -> None:
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()
