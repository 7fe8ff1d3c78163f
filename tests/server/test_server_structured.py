"""response_format against a real `plait serve` (default model): every finished output
parses and validates against the schema the client sent; streaming, n>1, seeds, logprobs,
stop strings and length cuts; the openai SDK's parse helpers; bad schemas are 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.server import MODEL, RemoteServer, error_of, parse_sse
from pydantic import BaseModel, Field


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def json_schema(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "object": {"type": "object", "properties": {
        "name": NAME, "nickname": {"type": ["string", "null"], "maxLength": 8},
        "active": {"type": "boolean"}}, "required": ["name", "active"]},
    "array": {"type": "object", "properties": {
        "colours": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["colours"]},
    "enum": {"type": "object", "properties": {
        "mood": {"enum": ["happy", "sad", "calm"]}, "level": {"enum": [1, 2, 3]}},
        "required": ["mood", "level"]},
    "refs": {"type": "object", "$defs": {
        "City": {"type": "object", "required": ["name", "country"],
                 "properties": {"name": NAME, "country": {"$ref": "#/$defs/Code"}}},
        "Code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
        "properties": {"home": {"$ref": "#/$defs/City"},
                       "trips": {"type": "array", "items": {"$ref": "#/$defs/City"},
                                 "maxItems": 2}},
        "required": ["home", "trips"]},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["code", "date"]},
    "numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}},
        "required": ["age", "score", "delta"]},
}


@pytest.mark.parametrize("kind", list(SCHEMAS))
def test_every_output_validates_against_the_schema(server: RemoteServer, kind: str) -> None:
    schema = SCHEMAS[kind]
    body = {"model": MODEL, "messages": user(f"Describe a person as JSON ({kind})."), "n": 2,
            "seed": 11, "max_tokens": 80, "temperature": 1.0,
            "response_format": json_schema(schema)}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_and_completions_response_format(server: RemoteServer) -> None:
    schema = SCHEMAS["enum"]
    with server.http() as http:
        chat = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": user("Reply with a JSON object."), "max_tokens": 40,
            "seed": 3, "response_format": {"type": "json_object"}}).json()
        completion = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "A mood as JSON:", "max_tokens": 40, "seed": 3, "n": 2,
            "response_format": json_schema(schema)}).json()
    choice = chat["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # a length cut of an open object: still a JSON object's beginning
        assert (choice["finish_reason"], choice["message"]["content"][0]) == ("length", "{")
    for choice in completion["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), schema)


def test_stream_n2_seed_logprobs_match_the_whole_response(server: RemoteServer) -> None:
    schema = SCHEMAS["array"]
    body = {"model": MODEL, "messages": user("List colours."), "n": 2, "seed": 5,
            "max_tokens": 60, "logprobs": True, "top_logprobs": 1,
            "response_format": json_schema(schema)}
    with server.http() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        raw = http.post("/v1/chat/completions", json={**body, "stream": True}).content
    texts, tokens, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in parse_sse(raw).chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            tokens[choice["index"]] += (choice["logprobs"] or {}).get("content") or []
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    for choice in whole["choices"]:
        index = choice["index"]
        assert (texts[index], finish[index]) == (choice["message"]["content"],
                                                 choice["finish_reason"])
        assert b"".join(bytes(t["bytes"]) for t in tokens[index]).decode() == texts[index]
        assert [t["token"] for t in choice["logprobs"]["content"]] == \
            [t["token"] for t in tokens[index]]
        jsonschema.validate(json.loads(texts[index]), schema)


def test_length_cut_and_stop_string(server: RemoteServer) -> None:
    schema = {"type": "object", "properties": {"answer": {"const": "yes"}},
              "required": ["answer"]}
    with server.http() as http:
        cut = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": user("Answer."), "max_tokens": 2,
            "response_format": json_schema(SCHEMAS["object"])}).json()["choices"][0]
        stopped = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": user("Answer."), "max_tokens": 20, "stop": ["yes"],
            "response_format": json_schema(schema)}).json()["choices"][0]
        whole = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": user("Answer."), "max_tokens": 20,
            "response_format": json_schema(schema)}).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"].startswith("{")
    assert (stopped["message"]["content"], stopped["finish_reason"]) == ('{"answer":"', "stop")
    assert (whole["message"]["content"], whole["finish_reason"]) == ('{"answer":"yes"}', "stop")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    languages: list[str] = Field(max_length=2)


def test_openai_sdk_parse_and_stream_helpers(server: RemoteServer) -> None:
    client = server.openai()
    messages = user("Invent a person: name, age, languages.")
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=80,
                                           seed=2, response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    assert person == Person.model_validate_json(parsed.choices[0].message.content)
    with client.chat.completions.stream(model=MODEL, messages=messages, max_tokens=80, seed=2,
                                        response_format=Person) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == person  # same seed, same output


def test_a_schema_nested_too_deeply_is_a_400(server: RemoteServer) -> None:
    """600 nested lists under `anyOf` parse as JSON but are deeper than the schema walk goes:
    a 400 naming the parameter, not a 500 (the JSON is written by hand: json.dumps
    cannot encode it either)."""
    depth = 600
    schema = '{"anyOf":' + "[" * depth + "{}" + "]" * depth + "}"
    for path, prompt, param in (
            ("/v1/chat/completions", '"messages":[{"role":"user","content":"hi"}]',
             "response_format"),
            ("/v1/completions", '"prompt":"hi"', "response_format")):
        body = (f'{{"model":"{MODEL}","max_tokens":1,{prompt},"response_format":'
                f'{{"type":"json_schema","json_schema":{{"name":"deep","schema":{schema}}}}}}}')
        with server.http() as http:
            response = http.post(path, content=body,
                                 headers={"Content-Type": "application/json"})
        error = error_of(response, 400)
        assert error["param"] == param and "nested too deeply" in error["message"], error
    server.assert_at_rest()


@pytest.mark.parametrize(("response_format", "param", "fragment"), [
    (json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}),
     "response_format.json_schema.schema", "not supported"),
    (json_schema({"type": "string", "pattern": "(unclosed"}),
     "response_format.json_schema.schema", "not supported"),
    (json_schema({"type": "object"}, name="bad name!"), "response_format.json_schema.name",
     "pattern"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}},
     "response_format.json_schema.schema", "expected an object"),
    ({"type": "json_schema"}, "response_format.json_schema", "Missing"),
    ({"type": "json_object", "json_schema": {"name": "x"}}, "response_format", "only allowed"),
    ({"type": "yaml"}, "response_format.type", "json_schema"),
    ({"type": "json_object", "extra": 1}, "response_format.extra", "Unrecognized"),
])
def test_bad_response_formats_are_400s(server: RemoteServer, response_format, param,
                                       fragment) -> None:
    with server.http() as http:
        for path, prompt in (("/v1/chat/completions", {"messages": user("hi")}),
                             ("/v1/completions", {"prompt": "hi"})):
            error = error_of(http.post(path, json={"model": MODEL, "max_tokens": 1, **prompt,
                                                   "response_format": response_format}), 400)
            assert error["param"] == param, error
            assert fragment in error["message"], error
    server.assert_at_rest()


def test_a_grammar_the_engine_cannot_compile_is_a_400_other_engine_errors_500() -> None:
    """Most bad schemas are refused before the engine sees them; one that fails only
    against the real tokenizer comes back as the engine's GRAMMAR_FAILED error: the
    client's fault, so a 400 with the reason's first line."""
    from plait.engine import GRAMMAR_FAILED
    from plait.server.generation import GenerationError, _api_error

    grammar = _api_error(GenerationError(f"{GRAMMAR_FAILED}: token 99999 is out of range\n"
                                         "  in rule start"))
    assert (grammar.status, grammar.code) == (400, "invalid_grammar")
    assert grammar.message == f"{GRAMMAR_FAILED}: token 99999 is out of range"
    other = _api_error(GenerationError("the engine process died"))
    assert other.status == 500
