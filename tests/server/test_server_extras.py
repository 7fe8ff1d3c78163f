"""vLLM's extension parameters against a real `plait serve`: continuous usage stats,
prompt_logprobs (scored once for n>1), return_token_ids, /tokenize's token_strs and chat
form, continue_final_message, the model card's max_model_len, and cached_tokens for n>1."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from helpers.server import MODEL, RemoteServer, error_of, parse_sse

GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}


def post(server: RemoteServer, path: str, body: dict[str, Any]):
    with server.http() as http:
        return http.post(path, json=body)


def ok(server: RemoteServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: RemoteServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = post(server, path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    sse = parse_sse(response.content)
    assert sse.events[-1] == "[DONE]"
    return sse.chunks


def tokenize(server: RemoteServer, **body: Any) -> dict[str, Any]:
    return ok(server, "/tokenize", {"model": MODEL, **body})


def unique(text: str) -> str:
    """A prompt no earlier request shares a block with (its first block is new)."""
    return f"{uuid.uuid4().hex} {text}"


def computed_prompt_tokens(server: RemoteServer) -> float:
    return server.metrics()["plait_prompt_tokens_computed_total"]


# ---------------------------------------------------------------- continuous usage
def test_chat_stream_continuous_usage_counts_each_choice(server: RemoteServer) -> None:
    messages = [{"role": "user", "content": unique("Count to five.")}]
    num_prompt = tokenize(server, messages=messages)["count"]
    chunks = stream(server, "/v1/chat/completions", {
        **GREEDY, "messages": messages, "n": 2, "max_tokens": 4, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *choice_chunks, last = chunks
    so_far = {0: 0, 1: 0}
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        so_far[choice["index"]] += len(choice.get("token_ids", []))
        assert chunk["usage"] == {"prompt_tokens": num_prompt,
                                  "completion_tokens": so_far[choice["index"]],
                                  "total_tokens": num_prompt + so_far[choice["index"]]}
    assert so_far == {0: 4, 1: 4}
    finishes = [c["choices"][0] for c in choice_chunks if c["choices"][0]["finish_reason"]]
    assert sorted((c["index"], c["finish_reason"]) for c in finishes) == [(0, "length"),
                                                                         (1, "length")]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert last["usage"]["prompt_tokens"] == num_prompt


def test_completions_stream_continuous_usage_per_prompt(server: RemoteServer) -> None:
    prompts = [unique("The sky is"), unique("One plus one is two, and two plus two")]
    lengths = [len(tokenize(server, prompt=p)["tokens"]) for p in prompts]
    chunks = stream(server, "/v1/completions", {
        **GREEDY, "prompt": prompts, "n": 2, "max_tokens": 3,
        "stream_options": {"continuous_usage_stats": True}})  # include_usage unset: vLLM's on
    *choice_chunks, last = chunks
    finals = {}
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == lengths[choice["index"] // 2]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= finals.get(choice["index"], 0)
        finals[choice["index"]] = usage["completion_tokens"]
    assert finals == {0: 3, 1: 3, 2: 3, 3: 3}
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == sum(lengths)
    # include_usage false turns all usage off, as in vLLM.
    quiet = stream(server, "/v1/completions", {
        **GREEDY, "prompt": prompts[0], "max_tokens": 2,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert all("usage" not in c for c in quiet)


# ---------------------------------------------------------------- return_token_ids
def test_chat_return_token_ids(server: RemoteServer) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    prompt_ids = tokenize(server, messages=messages)["tokens"]
    body = {**GREEDY, "messages": messages, "n": 2, "max_tokens": 5, "return_token_ids": True}
    result = ok(server, "/v1/chat/completions", body)
    assert result["prompt_token_ids"] == prompt_ids
    for choice in result["choices"]:
        assert len(choice["token_ids"]) == 5
        text = ok(server, "/detokenize", {"tokens": choice["token_ids"]})["prompt"]
        assert text == choice["message"]["content"]
    chunks = stream(server, "/v1/chat/completions", body)
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert [c["prompt_token_ids"] for c in roles] == [prompt_ids, prompt_ids]
    assert all("prompt_token_ids" not in c for c in chunks if c not in roles)
    for choice in result["choices"]:
        mine = [c["choices"][0] for c in chunks if c not in roles
                and c["choices"][0]["index"] == choice["index"]]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    plain = ok(server, "/v1/chat/completions", {**body, "return_token_ids": False})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completions_return_token_ids_with_echo_and_eos(server: RemoteServer) -> None:
    prompt = "The capital of France is"
    prompt_ids = tokenize(server, prompt=prompt)["tokens"]
    body = {"model": MODEL, "temperature": 0, "prompt": prompt, "echo": True, "n": 2,
            "max_tokens": 6, "return_token_ids": True}
    result = ok(server, "/v1/completions", body)
    for choice in result["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert len(choice["token_ids"]) == result["usage"]["completion_tokens"] // 2
        text = ok(server, "/detokenize", {"tokens": choice["token_ids"]})["prompt"]
        assert choice["text"] == prompt + text.removesuffix("<|endoftext|>").removesuffix(
            "<|im_end|>")
    chunks = stream(server, "/v1/completions", body)
    for choice in result["choices"]:
        mine = [c["choices"][0] for c in chunks
                if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
    scored = ok(server, "/v1/completions", {**body, "max_tokens": 0, "logprobs": 0})
    assert scored["choices"][0]["token_ids"] == [] and scored["usage"]["completion_tokens"] == 0


# ---------------------------------------------------------------- prompt_logprobs
def check_prompt_logprobs(entries: list, prompt_ids: list[int], k: int) -> None:
    """vLLM's shape: null first, then {id: {logprob, rank, decoded_token}}, the prompt
    token first (its own rank), then the top k with ranks 1..k."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        keys = list(entry)
        assert keys[0] == str(token_id)
        own = entry[str(token_id)]
        assert set(own) == {"logprob", "rank", "decoded_token"} and own["logprob"] <= 0
        top = sorted((v for key, v in entry.items() if key != str(token_id)),
                     key=lambda v: v["rank"])
        ranks = [v["rank"] for v in top]
        if own["rank"] <= k:  # the prompt token is one of the top k
            assert ranks == [r for r in range(1, k + 1) if r != own["rank"]]
        else:
            assert ranks == list(range(1, k + 1))
            assert all(v["logprob"] >= own["logprob"] for v in top)
        values = [v["logprob"] for v in sorted(entry.values(), key=lambda v: v["rank"])]
        assert values == sorted(values, reverse=True)


def test_completions_prompt_logprobs_scored_once_for_n_and_equal_to_n1(server) -> None:
    prompt = unique("Scoring this prompt once is the point of the exercise.")
    prompt_ids = tokenize(server, prompt=prompt)["tokens"]
    body = {**GREEDY, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3}
    before = computed_prompt_tokens(server)
    many = ok(server, "/v1/completions", {**body, "n": 3})
    assert computed_prompt_tokens(server) - before == len(prompt_ids)  # once, not 3 times
    one = ok(server, "/v1/completions", body)
    expected = one["choices"][0]["prompt_logprobs"]
    check_prompt_logprobs(expected, prompt_ids, 3)
    assert [c["prompt_logprobs"] for c in many["choices"]] == [expected] * 3
    decoded = ok(server, "/detokenize", {"tokens": prompt_ids[1:2]})["prompt"]
    assert expected[1][str(prompt_ids[1])]["decoded_token"] == decoded
    plain = ok(server, "/v1/completions", {**body, "prompt_logprobs": None})
    assert "prompt_logprobs" not in plain["choices"][0]


def test_echo_logprobs_with_n_score_the_prompt_once(server: RemoteServer) -> None:
    prompt = unique("Echo me back with the logprobs of every token.")
    prompt_ids = tokenize(server, prompt=prompt)["tokens"]
    num_prompt = len(prompt_ids)
    body = {**GREEDY, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 2}
    before = computed_prompt_tokens(server)
    many = ok(server, "/v1/completions", {**body, "n": 3, "prompt_logprobs": 4})
    assert computed_prompt_tokens(server) - before == num_prompt
    one = ok(server, "/v1/completions", body)["choices"][0]["logprobs"]
    for choice in many["choices"]:
        lp = choice["logprobs"]
        assert lp["token_logprobs"][:num_prompt] == one["token_logprobs"][:num_prompt]
        assert lp["top_logprobs"][:num_prompt] == one["top_logprobs"][:num_prompt]
        check_prompt_logprobs(choice["prompt_logprobs"], prompt_ids, 4)
        for i, entry in enumerate(choice["prompt_logprobs"][1:], start=1):
            assert entry[str(prompt_ids[i])]["logprob"] == lp["token_logprobs"][i]
            best = next(v for v in entry.values() if v["rank"] == 1)
            assert best["logprob"] == max(lp["top_logprobs"][i].values())


def test_chat_prompt_logprobs_at_the_top_level(server: RemoteServer) -> None:
    messages = [{"role": "user", "content": unique("Hello there.")}]
    prompt_ids = tokenize(server, messages=messages)["tokens"]
    body = {**GREEDY, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
    before = computed_prompt_tokens(server)
    many = ok(server, "/v1/chat/completions", {**body, "n": 2})
    # Scored whole (a cached system-prompt block has no scores), and once for both choices.
    assert computed_prompt_tokens(server) - before == len(prompt_ids)
    check_prompt_logprobs(many["prompt_logprobs"], prompt_ids, 1)
    assert "prompt_logprobs" not in many["choices"][0]
    assert ok(server, "/v1/chat/completions", body)["prompt_logprobs"] == many["prompt_logprobs"]
    zero = stream(server, "/v1/chat/completions", {**body, "prompt_logprobs": 0})
    assert all("prompt_logprobs" not in c for c in zero)


# ---------------------------------------------------------------- chat template flags
def test_continue_final_message(server: RemoteServer) -> None:
    start = "The three primary colors are"
    messages = [{"role": "user", "content": "List the primary colors."},
                {"role": "assistant", "content": start}]
    form = {"messages": messages, "continue_final_message": True}
    ids = tokenize(server, **form, add_generation_prompt=False)["tokens"]
    assert tokenize(server, **form)["tokens"] == ids  # unset add_generation_prompt: off
    rendered = ok(server, "/detokenize", {"tokens": ids})["prompt"]
    assert rendered.endswith(f"<|im_start|>assistant\n{start}")
    closed = tokenize(server, messages=messages, add_generation_prompt=False)["tokens"]
    assert len(closed) > len(ids) and closed[:len(ids)] == ids
    chat = ok(server, "/v1/chat/completions", {**GREEDY, **form, "max_tokens": 5})
    completion = ok(server, "/v1/completions", {**GREEDY, "prompt": ids, "max_tokens": 5})
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == len(ids)
    opened = tokenize(server, messages=messages)["tokens"]  # a new assistant turn
    assert ok(server, "/detokenize", {"tokens": opened})["prompt"].endswith(
        f"{start}<|im_end|>\n<|im_start|>assistant\n")


def test_tokenize_token_strs_and_model_card(server: RemoteServer) -> None:
    plain = tokenize(server, prompt="Hello world")
    assert plain["token_strs"] is None
    strs = tokenize(server, prompt="Hello world", return_token_strs=True)
    assert strs["token_strs"] == ["Hello", "Ġworld"] and strs["tokens"] == plain["tokens"]
    assert list(strs) == ["count", "max_model_len", "tokens", "token_strs"]
    chat = tokenize(server, messages=[{"role": "user", "content": "Hi"}],
                    return_token_strs=True)
    assert chat["token_strs"][-4:] == ["<|im_start|>", "ass", "istant", "Ċ"]
    assert len(chat["token_strs"]) == chat["count"]
    card = server.openai().models.retrieve(MODEL)
    assert card.max_model_len == plain["max_model_len"] == 8192  # type: ignore[attr-defined]
    with server.http() as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 8192


def test_tokenize_renders_a_tool_conversation_as_chat_does(server: RemoteServer) -> None:
    """An assistant turn with tool_calls (content null) and the tool's result: /tokenize
    renders them exactly as the chat endpoint does (same prompt token count)."""
    messages = [
        {"role": "user", "content": unique("What is the weather in Paris?")},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    counted = tokenize(server, messages=messages, return_token_strs=True)
    rendered = "".join(counted["token_strs"])
    assert '"name":"get_weather"' in rendered and "sunny" in rendered
    chat = ok(server, "/v1/chat/completions", {**GREEDY, "messages": messages, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == counted["count"]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "return_token_ids": "yes"}, "return_token_ids"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {
        "continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True,
                              "messages": [{"role": "assistant", "content": "A"}]},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "A"}],
                   "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "A", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "A", "return_token_strs": 1}, "return_token_strs"),
])
def test_bad_extras_are_400_naming_the_parameter(server, path, body, param) -> None:
    full = {"model": MODEL, "max_tokens": 1, **body}
    if path == "/v1/chat/completions":
        full.setdefault("messages", [{"role": "user", "content": "A"}])
    if path == "/tokenize":
        full.pop("max_tokens")
    error = error_of(post(server, path, full), 400)
    assert error["param"] == param, error


def test_unknown_parameters_stay_400_naming_them(server: RemoteServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A"}],
            "continuous_usage_stats": True, "return_tokens_as_token_ids": True}
    error = error_of(post(server, "/v1/chat/completions", body), 400)
    assert error["message"] == ("Unrecognized request arguments supplied: "
                                "continuous_usage_stats, return_tokens_as_token_ids")


# ---------------------------------------------------------------- cached tokens, n > 1
def test_cached_tokens_for_n_choices_first_request_and_repeat(server: RemoteServer) -> None:
    prompt = unique("cached tokens: describe this identifier in a few words, please.")
    num_prompt = len(tokenize(server, prompt=prompt)["tokens"])
    body = {**GREEDY, "prompt": prompt, "max_tokens": 2}
    first = ok(server, "/v1/completions", {**body, "n": 4})["usage"]
    # Computed once by one choice, read from the shared prefill by the other three.
    assert first["prompt_tokens"] == num_prompt
    assert first["prompt_tokens_details"] == {"cached_tokens": 3 * num_prompt // 4}
    again = ok(server, "/v1/completions", {**body, "n": 4})["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": num_prompt}
    single = ok(server, "/v1/completions", {**body, "prompt": unique("solo")})["usage"]
    assert single["prompt_tokens_details"] == {"cached_tokens": 0}
