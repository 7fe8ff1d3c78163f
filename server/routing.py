"""`ApiRoute`: the route class of the API routers. Before FastAPI reads a body it checks
the API key (so a request without a valid key gets 401 whatever its body), then parses the
body strictly, off the event loop when it is large:

    body bytes -> UTF-8 (invalid bytes are kept as lone surrogates, found below)
               -> JSON without NaN/Infinity and without duplicate keys
               -> no string (key or value) that is not valid Unicode: 400 naming its param

FastAPI then validates the already-parsed value (Starlette keeps it as `request._json`),
so the body is parsed once. The body size limit (413) runs before all this, as middleware.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from plait.server.auth import require_api_key
from plait.server.errors import JSON_PARSE_MESSAGE, APIError, bad_request, echo, param_name
from plait.server.offload import offload
from plait.server.serving import CLIENT_CLOSED_REQUEST

Handler = Callable[[Request], Coroutine[Any, Any, Response]]

# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF); pairs are fine, lone ones are not.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


class ApiRoute(APIRoute):
    """An API route: API key first, then the strict JSON body (see the module docstring)."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        has_body = self.body_field is not None

        async def guarded(request: Request) -> Response:
            require_api_key(request)
            if has_body:
                await _parse_json_body(request)
            return await handler(request)

        return guarded


async def _parse_json_body(request: Request) -> None:
    """Parse a JSON body into `request._json` (where `Request.json()` keeps it); a body
    that is not sent as JSON (or is empty) is left to FastAPI's own errors."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.partition(";")[0].strip().lower()
        if not (media_type == "application/json" or media_type.endswith("+json")):
            return
    try:
        body = await request.body()
    except ClientDisconnect:  # nobody reads the answer; the access log shows 499
        raise APIError(CLIENT_CLOSED_REQUEST, "The client disconnected while sending the "
                       "request body.") from None
    if body:
        request._json = await offload(parse_json, body, size=len(body))


def parse_json(body: bytes) -> Any:
    """The value of a JSON body, or a 400 `APIError`: malformed JSON, NaN/Infinity, a key
    twice in one object, or a string that is not valid Unicode (named by its param)."""
    body = body.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as json.loads allows
    try:
        text = body.decode("utf-8")
        suspect = _SURROGATE_ESCAPE.search(text) is not None
    except UnicodeDecodeError:  # keep going: the bad bytes become lone surrogates
        text, suspect = body.decode("utf-8", "surrogateescape"), True
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                           object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):  # syntax, nesting, a 5,000-digit number
        raise bad_request(JSON_PARSE_MESSAGE) from None
    if suspect:
        bad = _first_invalid_string(value)
        if bad is not None:
            name = param_name(("body", *bad)) or "body"
            raise bad_request(
                f"Invalid value for '{name}': the text is not valid Unicode (it holds a lone "
                "UTF-16 surrogate such as \\ud800, or bytes that are not UTF-8).",
                param_name(("body", *bad)), "invalid_value")
    return value


def _no_constant(name: str) -> NoReturn:
    raise bad_request(f"Invalid JSON: {name} is not a JSON number; send a finite number.")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400
        raise bad_request(f"Invalid JSON: the number {echo(text)} is out of range; send a "
                          "finite number.")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a key given twice is refused (parsers disagree on which one wins)."""
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise bad_request(f"Invalid JSON: the key {echo(key)} appears twice in one "
                              "object; each key must be unique.")
        seen.add(key)
    return result


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_invalid_string(value: Any) -> tuple[Any, ...] | None:
    """The location (keys and indices) of a string, or of the object holding a key, that
    is not valid Unicode; None if there is none. Linear in the size of `value`."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _valid_unicode(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _valid_unicode(key):
                    return path
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, i)) for i, child in reversed(list(enumerate(item))))
    return None
