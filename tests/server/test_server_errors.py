"""Error envelopes of the real server: status, type, param, code; never a traceback."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers.server import MODEL, RemoteServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    body = response.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param",
                                                               "code"]
    assert "Traceback" not in response.text and "/work/" not in response.text
    assert ".py" not in response.text
    return body["error"]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 1, **fields}


CASES = [
    # (path, body, param, code, message fragment)
    (CHAT, chat(n=129), "n", "integer_above_max_value", "Expected a value <= 128"),
    (CHAT, chat(n=0), "n", "integer_below_min_value", "Expected a value >= 1"),
    (CHAT, chat(n="2"), "n", "invalid_type", "expected an integer"),
    (CHAT, chat(temperature=2.5), "temperature", "decimal_above_max_value", "<= 2"),
    (CHAT, chat(max_tokens=0), "max_tokens", "integer_below_min_value", ">= 1"),
    (CHAT, chat(top_logprobs=2), "top_logprobs", None, "only allowed when 'logprobs'"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "integer_above_max_value",
     "<= 20"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options", None,
     "only allowed when 'stream' is enabled"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", "array_above_max_length",
     "maximum length 4"),
    (CHAT, chat(messages=[]), "messages", "empty_array", "empty array"),
    (CHAT, chat(messages=[{"role": "function", "content": "x"}]), "messages.[0].role",
     "invalid_value", "'system'"),
    (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "messages.[0].content.[0].type", "invalid_value", "image_url"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages.[0].content", "invalid_value", "null"),
    (CHAT, {"messages": MESSAGES}, "model", "missing_required_parameter", "'model'"),
    (CHAT, chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter",
     "'functions'"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format.type", "invalid_value",
     "json_schema"),
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias", None, "non-negative integers"),
    (CHAT, chat(logit_bias={"99999999": 1}), "logit_bias", None, "vocabulary"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", None, "between -100 and 100"),
    (CHAT, chat(min_tokens=5, max_tokens=2), "min_tokens", "invalid_value", "min_tokens"),
    (CHAT, chat(top_k=-5), "top_k", "integer_below_min_value", "top_k"),
    (CHAT, chat(messages=[{"role": "user", "content": "hi " * 9000}]), "messages",
     "context_length_exceeded", "maximum context length is 8192"),
    (COMPLETIONS, completion(prompt=[1, 2, 49152]), "prompt", "invalid_value", "49152"),
    (COMPLETIONS, completion(prompt=[[1, 2], [-1]]), "prompt", "invalid_value", "-1"),
    (COMPLETIONS, completion(prompt=[]), "prompt", "empty_array", "empty array"),
    (COMPLETIONS, completion(prompt=["a", 1]), "prompt", "invalid_type", "array of tokens"),
    (COMPLETIONS, completion(prompt=""), "prompt", "invalid_value", "empty"),
    (COMPLETIONS, completion(best_of=1, n=2), "best_of", None, "greater than or equal to n"),
    (COMPLETIONS, completion(best_of=3, stream=True), "best_of", None, "cannot be used"),
    (COMPLETIONS, completion(logprobs=6), "logprobs", "integer_above_max_value", "<= 5"),
    (COMPLETIONS, completion(suffix="x"), "suffix", "unsupported_parameter", "'suffix'"),
    (COMPLETIONS, completion(prompt=[7] * 8200), "prompt", "context_length_exceeded",
     "8192"),
    (COMPLETIONS, completion(stream=False, stream_options={}), "stream_options", None,
     "'stream' is enabled"),
]


@pytest.mark.parametrize(("path", "body", "param", "code", "fragment"), CASES,
                         ids=[f"{c[0].rsplit('/', 1)[1]}-{c[2]}-{i}" for i, c in
                              enumerate(CASES)])
def test_invalid_requests_are_400_envelopes(http, path, body, param, code, fragment) -> None:
    error = envelope(http.post(path, json=body), 400)
    assert (error["type"], error["param"], error["code"]) == \
        ("invalid_request_error", param, code)
    assert fragment in error["message"]


def test_unknown_arguments_are_rejected_like_openai(http) -> None:
    error = envelope(http.post(CHAT, json=chat(foo=1)), 400)
    assert error == {"message": "Unrecognized request argument supplied: foo",
                     "type": "invalid_request_error", "param": None, "code": None}
    error = envelope(http.post(COMPLETIONS, json=completion(foo=1, bar=2)), 400)
    assert error["message"] == "Unrecognized request arguments supplied: foo, bar"


def test_null_means_absent_and_off_values_are_accepted(http) -> None:
    body = chat(tools=None, temperature=None, response_format={"type": "text"}, user="u-1",
                stop=None, seed=None, messages=[{"role": "assistant", "content": "x",
                                                 "refusal": None, "tool_calls": None},
                                                {"role": "user", "content": "hi"}])
    assert http.post(CHAT, json=body).status_code == 200


def test_malformed_json_and_empty_body(http) -> None:
    for content in (b'{"model": "x", ', b"", b"[1, 2]"):
        error = envelope(http.post(CHAT, content=content,
                                   headers={"content-type": "application/json"}), 400)
        if content != b"[1, 2]":
            assert "could not parse the JSON body" in error["message"]


def test_unknown_model_routes_and_methods(server: RemoteServer, http) -> None:
    error = envelope(http.post(CHAT, json=chat(model="gpt-4o")), 404)
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    assert envelope(http.get("/v1/models/gpt-4o"), 404)["code"] == "model_not_found"
    assert envelope(http.get("/v1/nothing-here"), 404)["code"] == "not_found"
    assert envelope(http.get(CHAT), 405)["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as info:
        server.openai().chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, n=200)
    assert info.value.param == "n"


def test_api_key_from_the_environment_is_enforced(server: RemoteServer) -> None:
    url = server.url
    missing = envelope(httpx.post(url + CHAT, json=chat()), 401)
    assert missing["message"].startswith("You didn't provide an API key")
    assert missing["code"] is None
    wrong = httpx.post(url + CHAT, json=chat(), headers={"Authorization": "Bearer sk-wrong"})
    assert envelope(wrong, 401)["code"] == "invalid_api_key"
    assert "sk-wrong" not in wrong.text
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()


def test_streamed_validation_errors_are_plain_envelopes(http) -> None:
    response = http.post(CHAT, json=chat(stream=True, n=0))
    assert envelope(response, 400)["param"] == "n"
    assert json.loads(response.text)["error"]["code"] == "integer_below_min_value"
