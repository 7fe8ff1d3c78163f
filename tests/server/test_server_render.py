"""/v1/chat/completions/render and /v1/completions/render on a real server: the token ids
equal the ones the engine got for the same body (the generation endpoints' own
`prompt_token_ids`, with return_token_ids), and bad bodies get the same 400 envelopes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from helpers.requests import chat_body
from helpers.server import MODEL, RemoteServer, error_of

SYSTEM = [{"role": "system", "content": "You answer in one word."},
          {"role": "user", "content": "What colour is the sky?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
CONTINUE = [{"role": "user", "content": "Write a haiku about rain."},
            {"role": "assistant", "content": "Soft rain on the roof"}]


def rendered_chat(http: httpx.Client, body: dict[str, Any]) -> list[int]:
    response = http.post("/v1/chat/completions/render", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert list(result) == ["request_id", "model", "token_ids", "features"]
    assert result["request_id"].startswith("chatcmpl-") and result["model"] == MODEL
    assert result["features"] is None
    return result["token_ids"]


def engine_chat(http: httpx.Client, body: dict[str, Any]) -> list[int]:
    """The prompt ids /v1/chat/completions gave the engine (and counted in usage)."""
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["usage"]["prompt_tokens"] == len(result["prompt_token_ids"])
    return result["prompt_token_ids"]


RENDER = {"max_tokens": 1, "return_token_ids": True}


@pytest.mark.parametrize("body", [
    chat_body(SYSTEM, RENDER),
    chat_body(SYSTEM, RENDER, n=3, temperature=0.7, stream=True),  # sampling params change nothing
    chat_body([{"role": "user", "content": "Hi"}], RENDER, tools=TOOLS),
    chat_body(TOOL_CONVERSATION, RENDER, tools=TOOLS, tool_choice="auto"),
    chat_body(CONTINUE, RENDER, continue_final_message=True, add_generation_prompt=False),
    chat_body(CONTINUE, RENDER, add_generation_prompt=False),
], ids=["system", "sampling", "tools", "tool-results", "continue-final", "no-gen-prompt"])
def test_chat_render_is_what_the_engine_gets(http: httpx.Client, body) -> None:
    token_ids = rendered_chat(http, body)
    assert token_ids == engine_chat(http, {**body, "stream": False})


def test_chat_render_follows_the_template_flags(http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"model": MODEL, "messages": SYSTEM}).json()["tokens"]
    assert rendered_chat(http, chat_body(SYSTEM, RENDER)) == tokens
    with_tools = rendered_chat(http, chat_body(SYSTEM, RENDER, tools=TOOLS))
    assert len(with_tools) > len(tokens)  # the tools are described in the prompt
    continued = rendered_chat(http, chat_body(CONTINUE, RENDER, continue_final_message=True,
                                              add_generation_prompt=False))
    text = http.post("/detokenize", json={"tokens": continued}).json()["prompt"]
    assert text.endswith("Soft rain on the roof")
    fresh = rendered_chat(http, chat_body(CONTINUE, RENDER))
    text = http.post("/detokenize", json={"tokens": fresh}).json()["prompt"]
    assert text.endswith("Soft rain on the roof<|im_end|>\n<|im_start|>assistant\n")


def rendered_completion(http: httpx.Client, body: dict[str, Any]) -> list[list[int]]:
    response = http.post("/v1/completions/render", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert isinstance(result, list)
    for item in result:
        assert list(item) == ["request_id", "model", "token_ids", "features"]
        assert item["request_id"].startswith("cmpl-") and item["features"] is None
    return [item["token_ids"] for item in result]


@pytest.mark.parametrize("prompt", [
    "The capital of France is",
    [504, 3575, 282, 4649, 314],
    ["One prompt", "and another, longer prompt"],
    [[504, 3575], [282, 4649, 314]],
], ids=["string", "token-ids", "strings", "token-id-lists"])
def test_completion_render_is_what_the_engine_gets(http: httpx.Client, prompt) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "return_token_ids": True}
    token_ids = rendered_completion(http, body)
    result = http.post("/v1/completions", json=body).json()
    assert token_ids == [choice["prompt_token_ids"] for choice in result["choices"]]
    assert result["usage"]["prompt_tokens"] == sum(len(ids) for ids in token_ids)
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        assert token_ids == [prompt]


def test_render_generates_nothing(server: RemoteServer, http: httpx.Client) -> None:
    before = server.metrics()
    rendered_chat(http, chat_body(SYSTEM, RENDER, n=4, max_tokens=100))
    rendered_completion(http, {"model": MODEL, "prompt": "Hello", "n": 4})
    after = server.metrics()
    for name in ("plait_request_n_count", "plait_generation_tokens_total",
                 "plait_prefix_cache_queries_total"):
        assert after[name] == before[name], name


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", chat_body(SYSTEM, RENDER, bogus=1)),
    ("/v1/chat/completions", chat_body(SYSTEM, RENDER, continue_final_message=True)),
    ("/v1/chat/completions", chat_body(CONTINUE, RENDER, continue_final_message=True,
                                       add_generation_prompt=True)),
    ("/v1/chat/completions", chat_body(SYSTEM, RENDER, tool_choice="required")),
    ("/v1/chat/completions", chat_body([{"role": "user", "content": [{"type": "image_url"}]}],
                                       RENDER)),
    ("/v1/chat/completions", chat_body(SYSTEM, RENDER, top_logprobs=2)),
    ("/v1/chat/completions", chat_body(SYSTEM, RENDER, n=100000)),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}),
    ("/v1/completions", {"model": MODEL, "prompt": []}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {}}),
])
def test_bad_requests_get_the_real_endpoints_envelope(http: httpx.Client, path, body) -> None:
    error = error_of(http.post(f"{path}/render", json=body), 400)
    assert error == error_of(http.post(path, json=body), 400)


def test_unknown_model_and_api_key(server: RemoteServer, http: httpx.Client) -> None:
    body = chat_body(SYSTEM, RENDER, model="other")
    assert error_of(http.post("/v1/chat/completions/render", json=body), 404) == error_of(
        http.post("/v1/chat/completions", json=body), 404)
    for path, body in (("/v1/chat/completions/render", chat_body(SYSTEM, RENDER)),
                       ("/v1/completions/render", {"model": MODEL, "prompt": "x"})):
        error_of(httpx.post(f"{server.url}{path}", json=body, timeout=30), 401)
        error_of(httpx.post(f"{server.url}{path}", json=body, timeout=30,
                            headers={"Authorization": "Bearer wrong"}), 401)
