"""The app's OpenAPI document, told the truth about errors.

FastAPI documents a 422 `HTTPValidationError` on every route with parameters; Plait never
answers 422 (validation failures are 400s in the OpenAI envelope, see errors.py). This
module rewrites the generated document once: every operation lists its error statuses with
an `ErrorResponse` schema (the envelope), and the 422 schemas are gone.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from plait.server.errors import OVERLOADED_RETRY_AFTER_S, UNAVAILABLE_RETRY_AFTER_S

ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    }},
}
# Status -> description, for operations that take a body or a path parameter.
_API_ERRORS = {
    "400": "Invalid request (the `param` field names the parameter).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "413": "Request body over --max-request-bytes.",
    "500": "An error while serving this request.",
    "503": f"Overloaded (Retry-After: {OVERLOADED_RETRY_AFTER_S}), loading, draining or the "
           f"engine stopped (Retry-After: {UNAVAILABLE_RETRY_AFTER_S}).",
}
# GET /v1/models/{model}: authentication, the model name, readiness.
_LOOKUP_ERRORS = {status: _API_ERRORS[status] for status in ("401", "404", "503")}
# GET /v1/models: authentication and readiness only.
_GUARD_ERRORS = {status: _API_ERRORS[status] for status in ("401", "503")}
_HEALTH_503 = "Loading, draining after SIGTERM, or the engine stopped."
_LIVE_503 = "The engine stopped for good (restart the server)."


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def rewrite_errors(document: dict[str, Any]) -> dict[str, Any]:
    """Replace the 422 responses of `document` (in place) by the envelope's statuses."""
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                errors = _LOOKUP_ERRORS if method == "get" else _API_ERRORS
            elif path.startswith("/v1/"):
                errors = _GUARD_ERRORS
            elif path == "/health":
                errors = {"503": _HEALTH_503}
            elif path == "/live":
                errors = {"503": _LIVE_503}
            else:
                continue
            for status, description in errors.items():
                responses.setdefault(status, _error_response(description))
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    return document


def install_openapi(app: FastAPI) -> None:
    """Serve `rewrite_errors` of FastAPI's document at /openapi.json (built once, lazily)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = rewrite_errors(get_openapi(
                title=app.title, version=app.version, openapi_version=app.openapi_version,
                routes=app.routes, servers=app.servers))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
