"""/v1/responses without a model: the store (an injected clock, no sleeps), the item
translation, and the routes around a scripted engine (helpers/scripted.py's ScriptedCore: every
request gets " one two three ..."), for the error envelopes, the store bound, n>1
interleaving and a failure in the middle of a stream."""

from __future__ import annotations

import httpx
import pytest
from helpers.responses import check_stream, parse_events
from helpers.scripted import ScriptedCore, scripted_engine
from helpers.server import InProcessServer, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.cli import build_parser, server_settings
from plait.engine.model_loader import load_tokenizer
from plait.server.app import create_app
from plait.server.responses.store import ResponseStore
from plait.server.responses.translate import chat_messages, input_items
from plait.server.settings import ServerSettings

MODEL = "scripted-model"
KEY = "sk-responses"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------ store
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, response_id: str) -> None:
    store.put({"id": response_id}, [], [])


def test_store_drops_the_oldest_past_its_size() -> None:
    store = ResponseStore(3, ttl=60, clock=Clock())
    for i in range(5):
        _put(store, f"r{i}")
    assert [r for r in ("r0", "r1", "r2", "r3", "r4") if store.get(r)] == ["r2", "r3", "r4"]
    assert len(store) == 3
    assert store.delete("r3") and not store.delete("r3") and store.get("r3") is None
    _put(store, "r5")  # room after the delete: nothing else goes
    assert [r for r in ("r2", "r4", "r5") if store.get(r)] == ["r2", "r4", "r5"]


def test_store_expires_entries_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(10, ttl=60, clock=clock)
    _put(store, "old")
    clock.now += 30
    _put(store, "new")
    clock.now += 29.9
    assert store.get("old") is not None
    clock.now += 0.1  # 60 s after "old" was stored
    assert store.get("old") is None and store.get("new") is not None
    assert not store.delete("old") and len(store) == 1
    clock.now += 30
    assert store.get("new") is None and len(store) == 0


def test_store_of_size_zero_keeps_nothing() -> None:
    store = ResponseStore(0, ttl=60, clock=Clock())
    _put(store, "r")
    assert store.get("r") is None
    with pytest.raises(ValueError):
        ResponseStore(-1, ttl=60)
    with pytest.raises(ValueError):
        ResponseStore(1, ttl=0)


def test_store_options_reach_the_settings() -> None:
    parser = build_parser({"PLAIT_RESPONSES_TTL": "90"})
    settings = server_settings(parser.parse_args(["serve", "--responses-store-size", "5"]))
    assert (settings.responses_store_size, settings.responses_ttl) == (5, 90.0)
    assert (ServerSettings().responses_store_size, ServerSettings().responses_ttl) == (1000,
                                                                                      3600.0)
    with pytest.raises(ValueError):
        ServerSettings(responses_ttl=0)


# ------------------------------------------------------------------ translation
def test_items_become_chat_messages_with_calls_joined_to_their_turn() -> None:
    items = input_items([
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c":"P"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"c":"R"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "20"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "25"}]},
        {"type": "function_call", "call_id": "c3", "name": "w", "arguments": "{}"},
    ])
    assert [i["id"].split("_")[0] for i in items] == ["msg", "msg", "fc", "fc", "fco", "fco",
                                                      "fc"]
    assert chat_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c":"P"}'}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"c":"R"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "20"},
        {"role": "tool", "tool_call_id": "c2", "content": "25"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
    ]
    assert input_items("hi")[0]["content"] == [{"type": "input_text", "text": "hi"}]


# ------------------------------------------------------------------ routes (scripted engine)
@pytest.fixture(scope="module")
def scripted(default_model):
    core = ScriptedCore(load_tokenizer(default_model.path))
    app = create_app(ServerSettings(api_keys=(KEY,), responses_store_size=2),
                     engine=scripted_engine(core))
    with InProcessServer(app) as server, httpx.Client(base_url=server.url, headers=AUTH,
                                                      timeout=30) as http:
        assert _wait_ready(http)
        yield core, http


def _wait_ready(http: httpx.Client) -> bool:
    return wait_for(lambda: http.get("/health").status_code == 200, 30)


def _create(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    assert "Traceback" not in reply.text and ".py" not in reply.text
    return body["error"]


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools.[0].type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
     "tools.[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.[0].name"),
    ({"tools": [{"type": "function", "name": "f", "extra": 1}]}, "tools.[0].extra"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
                                                                      "name": "g"}},
     "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"include": ["file_search_call.results"]}, "include.[0]"),
    ({"n": 2, "tools": [{"type": "function", "name": "f"}]}, "n"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.[0].type"),
    ({"input": [{"type": ["message"]}]}, "input.[0].type"),
    ({"input": [{"role": "user", "content": [["x"]]}]}, "input.[0].content.[0].type"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input.[0].extra"),
    ({"input": [{"role": "user", "content": None}]}, "input.[0].content"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "text"}, "verbosity": "high"}}, "text.verbosity"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.[0].content.[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input.[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.[0].call_id"),
    ({"input": None}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
])
def test_bad_requests_name_the_parameter(scripted, body: dict, param: str) -> None:
    _, http = scripted
    error = _error(_create(http, **body), 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_unknown_parameters_are_named(scripted) -> None:
    _, http = scripted
    error = _error(_create(http, foo=1), 400)
    assert error["message"] == "Unrecognized request argument supplied: foo"  # as chat's


def test_unknown_ids_and_models_are_404s(scripted) -> None:
    _, http = scripted
    for reply in (http.get("/v1/responses/resp_nope"), http.delete("/v1/responses/resp_nope"),
                  http.get("/v1/responses/resp_nope/input_items")):
        assert "resp_nope" in _error(reply, 404)["message"]
    error = _error(_create(http, previous_response_id="resp_nope"), 404)
    assert error["param"] == "previous_response_id"
    assert _error(_create(http, model="other"), 404)["code"] == "model_not_found"


def test_routes_need_the_api_key_and_are_documented(scripted) -> None:
    _, http = scripted
    bare = httpx.Client(base_url=str(http.base_url))
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x"),
                         ("GET", "/v1/responses/resp_x/input_items")):
        assert bare.request(method, path, json={}).status_code == 401
    paths = http.get("/openapi.json").json()["paths"]
    assert {"post"} <= set(paths["/v1/responses"])
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "get" in paths["/v1/responses/{response_id}/input_items"]


def test_store_keeps_the_newest_responses(scripted) -> None:
    _, http = scripted  # responses_store_size=2
    ids = [_create(http, max_output_tokens=2).json()["id"] for _ in range(3)]
    assert http.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert [http.get(f"/v1/responses/{i}").json()["id"] for i in ids[1:]] == ids[1:]
    reply = http.get(f"/v1/responses/{ids[2]}/input_items", params={"limit": 0})
    assert _error(reply, 400)["param"] == "query.limit"  # the app's name for a query param


def test_n2_stream_interleaves_two_message_items(scripted) -> None:
    _, http = scripted
    reply = _create(http, n=2, max_output_tokens=4, stream=True)
    events = parse_events(reply.content)
    final = check_stream(events)
    deltas = [e["output_index"] for e in events if e["type"] == "response.output_text.delta"]
    assert sorted(set(deltas)) == [0, 1] and deltas[:2] == [0, 1]  # one step, both items
    assert [i["content"][0]["text"] for i in final["output"]] == [" one two three four"] * 2
    assert final["status"] == "incomplete"  # both cut at max_output_tokens
    assert [i["status"] for i in final["output"]] == ["incomplete"] * 2
    assert final["usage"]["output_tokens"] == 8


def test_engine_failure_mid_stream_is_an_error_event_then_failed(scripted) -> None:
    core, http = scripted
    core.fail_after = 2
    core.hold()  # a step per text delta read, so the failure merges with no token
    core.release(1)
    lines = []
    try:
        with http.stream("POST", "/v1/responses", json={
                "model": MODEL, "input": "hi", "max_output_tokens": 6, "stream": True}) as reply:
            for line in reply.iter_lines():
                lines.append(line)
                if line == "event: response.output_text.delta":
                    core.release(1)
    finally:
        core.fail_after = None
        core.run_freely()
    events = parse_events(("\n".join(lines) + "\n").encode())
    final = check_stream(events)
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "scripted engine failure"
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert [i["status"] for i in final["output"]] == ["incomplete"]
    assert final["output"][0]["content"][0]["text"] == " one two"
    assert "response.output_item.done" not in kinds


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["type", "role", "content", "text",
                                                         "name", "call_id", "arguments",
                                                         "output", "format", "schema"]),
                                       inner, max_size=4), max_leaves=12)
_fields = st.sampled_from(["input", "instructions", "tools", "tool_choice", "text", "include",
                           "previous_response_id", "n", "store", "metadata", "top_logprobs",
                           "max_output_tokens", "reasoning", "truncation"])


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(_fields, _json, max_size=4))
def test_hostile_bodies_get_an_answer_or_an_envelope(scripted, body: dict) -> None:
    """Never a 5xx: whatever the JSON, a response or a 4xx envelope."""
    _, http = scripted
    reply = _create(http, **{"max_output_tokens": 2, **body})
    assert reply.status_code < 500, (body, reply.text)
    if reply.status_code >= 400:
        _error(reply, reply.status_code)
