"""OpenAI error envelopes: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers installed by `install_error_handlers` turn `APIError`, pydantic validation errors
(400, never 422), unknown routes (404), wrong methods (405) and oversized bodies (413) into
that envelope. Unexpected exceptions are turned into a 500 envelope by `RequestIdMiddleware`,
so no stack trace or file path ever reaches a client.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

JSON_PARSE_MESSAGE = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The OpenAI API expects a JSON payload, but what was "
    "sent was not valid JSON.)")


class APIError(Exception):
    """An error a client sees as an OpenAI envelope with HTTP status `status`."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class EnvelopeResponse(JSONResponse):
    """JSON that always encodes: a lone surrogate in a message (a client value echoed back)
    becomes the JSON escape `\\udXXX` instead of a UnicodeEncodeError (a 500)."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")


def error_response(error: APIError) -> JSONResponse:
    return EnvelopeResponse(error.body(), status_code=error.status, headers=error.headers)


MAX_ECHO_CHARS = 80  # of a client value quoted in an error message


def echo(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as JSON for an error message (`null`, `{"a":null}`, `"x"`), never Python's
    spelling, cut to about `limit` characters ("..." marks the cut). The work is bounded by
    `limit`, not by the size of `value`."""
    text = _clipped_json(value, limit)
    return text if len(text) <= limit else text[:limit] + "..."


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """A client string quoted inside a message (the model name): cut to `limit` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def _clipped_json(value: Any, budget: int) -> str:
    if isinstance(value, str):
        return json.dumps(value[:budget + 1], ensure_ascii=False)
    if isinstance(value, (dict, list)):
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        parts: list[str] = []
        used = 2
        for key, item in items:
            if used > budget:
                parts.append("...")
                break
            part = _clipped_json(item, budget - used)
            if isinstance(value, dict):
                part = f"{_clipped_json(str(key), budget - used)}:{part}"
            parts.append(part)
            used += len(part) + 1
        inner = ",".join(parts)
        return f"{{{inner}}}" if isinstance(value, dict) else f"[{inner}]"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**40:
        if value.bit_length() > 10_000:  # past what int -> str converts (4300 digits)
            return f"(an integer of {value.bit_length()} bits)"
        return f"{'-' if value < 0 else ''}{str(abs(value))[:budget + 1]}"
    try:
        return json.dumps(value)  # null, true, 1.5, NaN never gets here (refused as JSON)
    except (TypeError, ValueError):
        return json.dumps(str(value)[:budget + 1])


def server_error(message: str = "The server had an error while processing your request.",
                 ) -> APIError:
    return APIError(500, message, type=SERVER_ERROR)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# Retry-After (seconds) of the two 503s: a full admission window frees up fast; loading,
# draining or a stopped engine does not.
OVERLOADED_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 5
ENGINE_STOPPED_MESSAGE = "The engine stopped; the server must be restarted."


def service_unavailable(message: str) -> APIError:
    """503 while the engine cannot take requests: loading, draining, or stopped."""
    return APIError(503, message, type=SERVER_ERROR, code="service_unavailable",
                    headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


# ------------------------------------------------------------------ pydantic -> envelope
# Union branches show up in pydantic locations as type tags ("str", "list[int]", ...).
_TYPE_TAG = re.compile(
    r"^(str|int|float|bool|none|dict|list|.*\[.*\]|function-.*|constrained-.*)$")


def param_name(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages.[0].content" (OpenAI's spelling)."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _TYPE_TAG.match(str(item)):
            parts.append(str(item))
    return ".".join(parts) or None


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The envelope OpenAI would send for these pydantic errors (the first one wins, except
    that a JSON syntax error or unknown fields are reported before anything else)."""
    if not errors or any(e.get("type") == "json_invalid" for e in errors):
        return bad_request(JSON_PARSE_MESSAGE)
    if errors[0].get("type") == "missing" and tuple(errors[0]["loc"]) == ("body",):
        return bad_request(JSON_PARSE_MESSAGE)  # no body at all
    if isinstance(errors[0].get("input"), bytes):  # not sent as application/json
        return bad_request("The request body must be JSON, sent with the header "
                           "'Content-Type: application/json'.")
    extra = [param_name(e["loc"]) for e in errors if e.get("type") == "extra_forbidden"]
    top_level = [name for name in extra if name and "." not in name]
    if top_level:
        plural = "s" if len(top_level) > 1 else ""
        return bad_request(f"Unrecognized request argument{plural} supplied: "
                           f"{', '.join(top_level)}")
    first = param_name(tuple(errors[0]["loc"]))
    branches = [e for e in errors if _within(param_name(tuple(e["loc"])), first)]
    if len(branches) > 1:  # a union: report a range/length error, else a type error
        specific = [e for e in branches if _expected(e) is None]
        if specific:
            return _one_error(specific[0])
        expected = " or ".join(dict.fromkeys(_expected(e) or "" for e in branches))
        return _type_error(first, expected, errors[0].get("input"))
    return _one_error(errors[0])


def _within(name: str | None, first: str | None) -> bool:
    """`name` is `first` or inside it ("stop.[0]" is inside "stop": a union's list branch)."""
    return name == first or (first is not None and name is not None
                             and name.startswith(first + "."))


_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "a boolean", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object",
             "none_required": "null", "int_from_float": "an integer"}


def _expected(error: Mapping[str, Any]) -> str | None:
    return _EXPECTED.get(error.get("type", ""))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _type_error(param: str | None, expected: str, value: Any) -> APIError:
    return bad_request(f"Invalid type for '{param or 'body'}': expected {expected}, but got "
                       f"{_json_type(value)} instead.", param, "invalid_type")


def _one_error(error: Mapping[str, Any]) -> APIError:
    param = param_name(tuple(error.get("loc", ())))
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    value = error.get("input")
    name = param or "body"
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{name}'.", param,
                           "missing_required_parameter")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized argument supplied: '{name}'.", param)
    if kind in ("less_than_equal", "less_than"):
        what = "integer" if isinstance(value, int) else "decimal"
        op = "<=" if kind == "less_than_equal" else "<"
        return bad_request(
            f"Invalid '{name}': {what} above maximum value. Expected a value {op} "
            f"{ctx.get('le', ctx.get('lt'))}, but got {echo(value)} instead.", param,
            f"{what}_above_max_value")
    if kind in ("greater_than_equal", "greater_than"):
        what = "integer" if isinstance(value, int) else "decimal"
        op = ">=" if kind == "greater_than_equal" else ">"
        return bad_request(
            f"Invalid '{name}': {what} below minimum value. Expected a value {op} "
            f"{ctx.get('ge', ctx.get('gt'))}, but got {echo(value)} instead.", param,
            f"{what}_below_min_value")
    if kind == "too_long":
        return bad_request(
            f"Invalid '{name}': array too long. Expected an array with maximum length "
            f"{ctx.get('max_length')}, but got an array with length "
            f"{ctx.get('actual_length')} instead.", param, "array_above_max_length")
    if kind == "string_too_long":
        length = len(value) if isinstance(value, str) else "more"
        return bad_request(
            f"Invalid '{name}': string too long. Expected a string with maximum length "
            f"{ctx.get('max_length')}, but got a string with length {length} instead.", param,
            "string_above_max_length")
    if kind == "too_short":
        return bad_request(
            f"Invalid '{name}': empty array. Expected an array with minimum length "
            f"{ctx.get('min_length')}, but got an empty array instead.", param, "empty_array")
    expected = _expected(error)
    if expected is not None:
        return _type_error(param, expected, value)
    message = str(error.get("msg", "invalid value"))
    return bad_request(f"Invalid value for '{name}': {message}.", param, "invalid_value")


# ------------------------------------------------------------------ handlers
async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(list(exc.errors())))


async def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        error = APIError(404, "Not found: no such route.", code="not_found")
    elif status == 405:
        error = APIError(405, "Method not allowed for this route.", code="method_not_allowed")
    elif status == 413:
        error = APIError(413, str(exc.detail), code="request_too_large")
    else:
        error = APIError(status, str(exc.detail), type=INVALID_REQUEST if status < 500
                         else SERVER_ERROR)
    error.headers = dict(exc.headers or {})
    return error_response(error)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
