"""Schemathesis against the real server's own OpenAPI document (/openapi.json): generated
valid and invalid bodies for chat, completions, tokenize and detokenize. Never a 5xx, every
non-2xx body is exactly the OpenAI envelope, and the server is healthy afterwards.

The schema is tightened before generating (model = the served name, max_tokens <= 3,
n/best_of <= 2, ...) so that valid cases reach the engine yet stay cheap on a CPU model;
invalid cases are generated from it by schemathesis' negative mode.
Generation is derandomized: the same few hundred cases run every time.
"""

from __future__ import annotations

from collections import Counter
from itertools import product
from typing import Any

import httpx
import schemathesis
from helpers.server import MODEL, RemoteServer
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

OPERATIONS = {"/v1/chat/completions": 45, "/v1/completions": 45, "/tokenize": 25,
              "/detokenize": 25}  # examples per mode (valid and invalid): ~280 in all
VOCAB_SIZE = 49152  # the default model's
CAPS = {"max_completion_tokens": 3, "n": 2, "best_of": 2, "min_tokens": 2}


def _tighten(document: dict[str, Any]) -> dict[str, Any]:
    """Cap the costly integers, pin `model`, make the parameters Plait rejects unless null
    (declared `Any`: no type) null, and give `prompt` its real forms, so that valid cases
    reach the engine instead of ending in a 400."""
    for title, schema in document["components"]["schemas"].items():
        properties = schema.get("properties", {})
        for name, prop in properties.items():
            if not {"type", "anyOf", "$ref", "items", "enum"} & set(prop):
                properties[name] = {"type": "null"}
        if title == "ChatMessage":
            part = {"type": "object", "required": ["type", "text"], "properties": {
                "type": {"enum": ["text"]}, "text": {"type": "string"}},
                "additionalProperties": False}
            properties["content"] = {"anyOf": [{"type": "string"}, {
                "type": "array", "items": part}]}
            schema["required"] = [*schema.get("required", []), "content"]
        if title == "CompletionRequest":
            token = {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}
            properties["prompt"] = {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "array", "items": token, "minItems": 1}]}
        for name, cap in CAPS.items():
            for branch in properties.get(name, {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch["maximum"] = cap
        if "max_tokens" in properties:  # absent, chat runs to the end of the context
            properties["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 3}
            schema["required"] = [*schema.get("required", []), "max_tokens"]
        if "model" in properties:
            pinned = {"type": "string", "enum": [MODEL]}
            if "anyOf" in properties["model"]:
                properties["model"]["anyOf"] = [pinned, {"type": "null"}]
            else:
                properties["model"] = pinned
    return document


def _check(response: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.content[:500])
    if response.status_code < 300:
        return
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert list(error) == ["message", "type", "param", "code"], body
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code"))
    assert "Traceback" not in error["message"] and ".py" not in error["message"]


def _integral(value: Any) -> Any:
    """3.0 -> 3 throughout a body: JSON Schema counts 3.0 as an integer and schemathesis
    sends it so, but Plait validates strictly (a 400), which would stop most valid cases."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _fuzz(server: RemoteServer, operation: Any, mode: GenerationMode, num_examples: int,
          statuses: Counter[int]) -> None:
    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def run(case: Any) -> None:
        if mode.is_positive:
            case.body = _integral(case.body)
        response = case.call(base_url=server.url, headers=server.headers, timeout=60)
        statuses[response.status_code] += 1
        _check(response)

    run()


def test_fuzzed_requests_get_2xx_or_a_4xx_envelope(server: RemoteServer) -> None:
    document = _tighten(httpx.get(f"{server.url}/openapi.json", timeout=30).json())
    schema = schemathesis.openapi.from_dict(document)
    statuses: Counter[int] = Counter()
    for (path, num_examples), mode in product(OPERATIONS.items(), GenerationMode):
        _fuzz(server, schema[path]["POST"], mode, num_examples, statuses)
    assert statuses.total() >= 200 and statuses[200] >= 20, statuses
    with server.http() as http:
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
