"""/openapi.json documents what Plait answers: errors as the OpenAI envelope, never 422."""

from __future__ import annotations

import json

from plait.server.app import create_app
from plait.server.settings import ServerSettings

ENVELOPE_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _document() -> dict:
    return create_app(ServerSettings()).openapi()  # no engine load needed for the document


def test_no_422_anywhere_and_the_envelope_schema_is_declared() -> None:
    document = _document()
    assert '"422"' not in json.dumps(document)
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    error = schemas["ErrorResponse"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]


def test_body_routes_list_the_envelope_statuses() -> None:
    paths = _document()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert sorted(responses) == ["200", "400", "401", "404", "413", "500", "503"], path
        for status in ("400", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == ENVELOPE_REF
    assert sorted(paths["/v1/models"]["get"]["responses"]) == ["200", "401", "503"]
    assert sorted(paths["/v1/models/{model}"]["get"]["responses"]) == ["200", "401", "404",
                                                                      "503"]
    assert sorted(paths["/health"]["get"]["responses"]) == ["200", "503"]
    assert sorted(paths["/metrics"]["get"]["responses"]) == ["200"]


def test_document_is_built_once() -> None:
    app = create_app(ServerSettings())
    assert app.openapi() is app.openapi()
