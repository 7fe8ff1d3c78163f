"""vLLM's extensions of issue 24 (point 5) against a real `plait serve`: /tokenize with
`tools`, GET /tokenizer_info, truncate_prompt_tokens / truncation_side, allowed_token_ids
and the `structured_outputs` request field, each compared with the equivalent Plait path
(render, response_format) and with its 400s."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from helpers.server import MODEL, RemoteServer, error_of

GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is the weather in Paris today?"}]
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest"


def ok(http, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def bad(http, path: str, body: dict[str, Any], param: str | None) -> dict[str, Any]:
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param, error
    return error


# ---------------------------------------------------------------- /tokenize with tools
def test_tokenize_with_tools_is_the_chat_prompt(http) -> None:
    rendered = ok(http, "/v1/chat/completions/render",
                  {"model": MODEL, "messages": MESSAGES, "tools": TOOLS})["token_ids"]
    tokens = ok(http, "/tokenize", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS})
    assert tokens["tokens"] == rendered and tokens["count"] == len(rendered)
    plain = ok(http, "/tokenize", {"model": MODEL, "messages": MESSAGES})["tokens"]
    assert plain != rendered and len(plain) < len(rendered)  # the tools are in the prompt
    # The same flags as without tools.
    no_gen = ok(http, "/tokenize", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                    "add_generation_prompt": False})["tokens"]
    assert no_gen == ok(http, "/v1/chat/completions/render", {
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS,
        "add_generation_prompt": False})["token_ids"]


def test_tokenize_tools_errors(http) -> None:
    bad(http, "/tokenize", {"model": MODEL, "prompt": "hi", "tools": TOOLS}, "tools")
    bad(http, "/tokenize", {"model": MODEL, "messages": MESSAGES,
                            "tools": [{"type": "function"}]}, "tools.[0].function")


# ---------------------------------------------------------------- /tokenizer_info
def test_tokenizer_info(http, server: RemoteServer) -> None:
    response = http.get("/tokenizer_info")
    assert response.status_code == 200, response.text
    info = response.json()
    tokenize = ok(http, "/tokenize", {"model": MODEL, "prompt": "x"})
    # The loaded class (transformers' name for it differs across versions).
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert isinstance(info["model_max_length"], int)
    # SmolLM2's tokenizer_config.json, AddedTokens as their text.
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>"
    assert "<|im_start|>" in info["chat_template"] and "{%" in info["chat_template"]
    for key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        assert key not in info
    assert "/work/" not in response.text and "/home/" not in response.text
    assert tokenize["max_model_len"] > 0
    # Guarded like /tokenize: without the key (when the server has one) it is a 401.
    if server.headers:
        import httpx

        assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401


# ---------------------------------------------------------------- truncation
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_left_and_right(http, path: str) -> None:
    if path == "/v1/completions":
        base = {**GREEDY, "prompt": PROMPT, "max_tokens": 2}
        full = ok(http, "/tokenize", {"model": MODEL, "prompt": PROMPT})["tokens"]
    else:
        base = {**GREEDY, "messages": MESSAGES, "max_tokens": 2}
        full = ok(http, "/tokenize", {"model": MODEL, "messages": MESSAGES})["tokens"]

    def prompt_ids(extra: dict[str, Any]) -> tuple[list[int], int]:
        result = ok(http, path, {**base, "return_token_ids": True, **extra})
        ids = (result["choices"][0]["prompt_token_ids"] if path == "/v1/completions"
               else result["prompt_token_ids"])
        assert result["usage"]["prompt_tokens"] == len(ids)
        return ids, result["usage"]["prompt_tokens"]

    k = 7
    assert prompt_ids({"truncate_prompt_tokens": k}) == (full[-k:], k)
    assert prompt_ids({"truncate_prompt_tokens": k, "truncation_side": "left"}) == (full[-k:], k)
    assert prompt_ids({"truncate_prompt_tokens": k, "truncation_side": "right"}) == (full[:k], k)
    # k at least the prompt's length, or -1 (the context): unchanged.
    assert prompt_ids({"truncate_prompt_tokens": len(full)})[0] == full
    assert prompt_ids({"truncate_prompt_tokens": -1})[0] == full
    # The render endpoints see the same ids.
    render = ok(http, f"{path}/render", {**base, "truncate_prompt_tokens": k})
    rendered = render["token_ids"] if "token_ids" in render else render[0]["token_ids"]
    assert rendered == full[-k:]


def test_truncate_completion_echo_and_token_prompts(http) -> None:
    full = ok(http, "/tokenize", {"model": MODEL, "prompt": PROMPT})["tokens"]
    result = ok(http, "/v1/completions", {**GREEDY, "prompt": [full, full[:5]], "max_tokens": 1,
                                          "echo": True, "truncate_prompt_tokens": 4,
                                          "return_token_ids": True})
    choices = sorted(result["choices"], key=lambda c: c["index"])
    assert [c["prompt_token_ids"] for c in choices] == [full[-4:], full[1:5]]
    detok = ok(http, "/detokenize", {"model": MODEL, "tokens": full[-4:]})["prompt"]
    assert choices[0]["text"].startswith(detok)


def test_truncation_errors(http) -> None:
    max_len = ok(http, "/tokenize", {"model": MODEL, "prompt": "x"})["max_model_len"]
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        error = bad(http, path, {**GREEDY, **body, "max_tokens": 1,
                                 "truncate_prompt_tokens": max_len + 1}, "truncate_prompt_tokens")
        assert "greater than max_model_len" in error["message"]
        bad(http, path, {**GREEDY, **body, "truncate_prompt_tokens": -2},
            "truncate_prompt_tokens")
        bad(http, path, {**GREEDY, **body, "truncation_side": "middle"}, "truncation_side")


# ---------------------------------------------------------------- allowed_token_ids
def test_allowed_token_ids_restrict_sampling(http) -> None:
    allowed = ok(http, "/tokenize", {"model": MODEL, "prompt": " cat dog bird",
                                     "add_special_tokens": False})["tokens"]
    assert len(set(allowed)) == 3
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        result = ok(http, path, {"model": MODEL, "temperature": 1.0, "seed": 5, "n": 3,
                                 "max_tokens": 8, "ignore_eos": True, **body,
                                 "allowed_token_ids": allowed, "return_token_ids": True})
        for choice in result["choices"]:
            assert len(choice["token_ids"]) == 8
            assert set(choice["token_ids"]) <= set(allowed), choice
        # Greedy with one allowed id: that id every time.
        one = ok(http, path, {**GREEDY, **body, "max_tokens": 4, "return_token_ids": True,
                              "allowed_token_ids": [allowed[1]]})
        assert one["choices"][0]["token_ids"] == [allowed[1]] * 4


def test_allowed_token_ids_errors(http) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        error = bad(http, path, {**GREEDY, **body, "allowed_token_ids": []},
                    "allowed_token_ids")
        assert "at least one" in error["message"]
        error = bad(http, path, {**GREEDY, **body, "allowed_token_ids": [5, 10**9]},
                    "allowed_token_ids")
        assert "outside the vocabulary" in error["message"]
        bad(http, path, {**GREEDY, **body, "allowed_token_ids": [-1]}, "allowed_token_ids")
        bad(http, path, {**GREEDY, **body, "allowed_token_ids": ["5"]},
            "allowed_token_ids.[0]")


# ---------------------------------------------------------------- structured_outputs
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _texts(http, path: str, body: dict[str, Any]) -> list[str]:
    result = ok(http, path, body)
    key = "text" if path == "/v1/completions" else "message"
    return [c[key] if key == "text" else c[key]["content"] for c in result["choices"]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_structured_outputs_json_equals_response_format(http, path: str) -> None:
    body = ({"prompt": "A person as JSON:"} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "Give me a person as JSON."}]})
    base = {"model": MODEL, "temperature": 0.8, "seed": 11, "n": 2, "max_tokens": 40, **body}
    via_rf = _texts(http, path, {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
    for spelling in (SCHEMA, json.dumps(SCHEMA)):
        via_so = _texts(http, path, {**base, "structured_outputs": {"json": spelling}})
        assert via_so == via_rf
    for text in via_rf:
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    via_object = _texts(http, path, {**base, "response_format": {"type": "json_object"}})
    assert _texts(http, path, {**base, "structured_outputs": {"json_object": True}}) == via_object


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_structured_outputs_choice_regex_grammar(http, path: str) -> None:
    body = ({"prompt": "Is the sky blue? Answer:"} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "Is the sky blue?"}]})
    base = {"model": MODEL, "temperature": 1.0, "seed": 3, "n": 4, "max_tokens": 12, **body}
    for text in _texts(http, path, {**base, "structured_outputs": {"choice": ["yes", "no",
                                                                              "maybe"]}}):
        assert text in {"yes", "no", "maybe"}
    for text in _texts(http, path, {**base, "structured_outputs": {"regex": r"[0-9]{3}-[a-c]"}}):
        assert re.fullmatch(r"[0-9]{3}-[a-c]", text), text
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    lark = 'start: "color: " ("red" | "green" | "blue")'
    via_gbnf = _texts(http, path, {**base, "structured_outputs": {"grammar": gbnf}})
    assert via_gbnf == _texts(http, path, {**base, "structured_outputs": {"grammar": lark}})
    for text in via_gbnf:
        assert text in {"color: red", "color: green", "color: blue"}, text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_structured_outputs_errors(http, path: str) -> None:
    body = {**GREEDY, "max_tokens": 2, **({"prompt": "x"} if path == "/v1/completions" else
                                          {"messages": MESSAGES})}
    bad(http, path, {**body, "structured_outputs": {}}, "structured_outputs")
    bad(http, path, {**body, "structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs")
    bad(http, path, {**body, "structured_outputs": {"regex": "a"},
                     "response_format": {"type": "json_object"}}, "structured_outputs")
    bad(http, path, {**body, "structured_outputs": {"regex": "a", "bogus": 1}},
        "structured_outputs.bogus")
    bad(http, path, {**body, "structured_outputs": {"choice": []}}, "structured_outputs.choice")
    bad(http, path, {**body, "structured_outputs": {"choice": [1]}}, "structured_outputs.choice")
    bad(http, path, {**body, "structured_outputs": {"regex": "(unclosed"}},
        "structured_outputs.regex")
    bad(http, path, {**body, "structured_outputs": {"json": "{not json"}},
        "structured_outputs.json")
    bad(http, path, {**body, "structured_outputs": {"grammar": "root ::= (("}},
        "structured_outputs.grammar")
    bad(http, path, {**body, "structured_outputs": "json"}, "structured_outputs")
    # Unknown top-level parameters are still refused by name (OpenAI's message, no param).
    error = bad(http, path, {**body, "guided_bogus": 1}, None)
    assert error["message"] == "Unrecognized request argument supplied: guided_bogus"


def test_structured_outputs_with_tools_is_refused(http) -> None:
    bad(http, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "tools": TOOLS,
                                       "structured_outputs": {"choice": ["a"]}},
        "structured_outputs")
    # tool_choice "none": the tools only show in the prompt, the constraint applies.
    texts = _texts(http, "/v1/chat/completions", {
        **GREEDY, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
        "max_tokens": 4, "structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert texts[0] in {"sunny", "rainy"}


# ---------------------------------------------------------------- engine units
def test_sampler_allowed_token_ids_mask() -> None:
    import torch

    from plait.engine import InvalidParamError, SamplingParams
    from plait.engine.sampler import apply_allowed_token_ids

    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    apply_allowed_token_ids(logits, [[1, 4, 99], None])
    assert logits[0].tolist() == [float("-inf"), 1.0, float("-inf"), float("-inf"), 4.0,
                                  float("-inf")]
    assert logits[1].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    with pytest.raises(InvalidParamError) as exc:
        SamplingParams(allowed_token_ids=[])
    assert exc.value.param == "allowed_token_ids"
