"""tools / tool_choice against a real `plait serve` (default model, whose template has no
tool format: tools are described in a system message and constrained by grammar).
Arguments validate against each tool's schema; streamed deltas reassemble (openai SDK) to
the non-streamed message of the same seed; conversations with tool calls and results are
accepted; bad shapes are 400s naming the parameter."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.server import MODEL, RemoteServer, error_of

from plait.server.constrained.output_plan import plan_output, render_messages
from plait.server.prompts import chat_token_ids
from plait.server.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the time in a time zone.",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}/[A-Z][a-z]{2,10}$"}},
        "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def assert_valid_calls(message, num_calls: int | None = None) -> list:
    calls = message.tool_calls or []
    assert calls, message
    if num_calls is not None:
        assert len(calls) == num_calls
    ids = [call.id for call in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in calls:
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(call.function.name, call.function.arguments) for call in calls]


def test_required_and_named_calls_validate(server: RemoteServer) -> None:
    client = server.openai()
    required = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, n=2, seed=4, max_tokens=60)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert_valid_calls(choice.message, num_calls=1)
    named = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, seed=4, max_tokens=60)
    choice = named.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert assert_valid_calls(choice.message, num_calls=1)[0][0] == "get_weather"


def test_auto_text_or_call(server: RemoteServer, tokenizer) -> None:
    client = server.openai()
    text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
        temperature=0, max_tokens=12)
    choice = text.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.message.content[0] not in "{[ \n"
    # Biased towards "{": the grammar turns the output into a valid call.
    brace = {str(tokenizer.convert_tokens_to_ids(t)): 100 for t in ("{", '{"')}
    called = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, parallel_tool_calls=False, seed=1,
        max_tokens=60, logit_bias=brace)
    choice = called.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert_valid_calls(choice.message, num_calls=1)


def test_none_never_calls(server: RemoteServer) -> None:
    response = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", seed=1, max_tokens=8)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


def collect(stream) -> dict[int, dict]:
    """Per choice index: content, calls [(name, arguments)], finish_reason and how many
    deltas carried call fragments (accumulated as the openai SDK documents it)."""
    result: dict[int, dict] = {}
    for chunk in stream:
        for choice in chunk.choices:
            entry = result.setdefault(choice.index, {"content": None, "calls": [],
                                                     "fragments": 0, "finish": None})
            if choice.delta.content:
                entry["content"] = (entry["content"] or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                entry["fragments"] += 1
                if call.index == len(entry["calls"]):
                    assert call.id.startswith("call_") and call.type == "function"
                    entry["calls"].append([call.function.name, ""])
                entry["calls"][call.index][1] += call.function.arguments or ""
            if choice.finish_reason:
                entry["finish"] = choice.finish_reason
    return result


@pytest.mark.parametrize(("tool_choice", "n"), [("required", 2), (NAMED, 1)])
def test_streamed_tool_calls_equal_the_whole_response(server: RemoteServer, tool_choice,
                                                      n: int) -> None:
    client = server.openai()
    args = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, n=n,
                seed=9, max_tokens=60, parallel_tool_calls=False)
    whole = client.chat.completions.create(**args)
    streamed = collect(client.chat.completions.create(**args, stream=True))
    assert sorted(streamed) == list(range(n))
    for choice in whole.choices:
        got = streamed[choice.index]
        assert [tuple(c) for c in got["calls"]] == assert_valid_calls(choice.message)
        assert (got["content"], got["finish"]) == (None, "tool_calls")
        if tool_choice == NAMED:  # the arguments stream as they are generated
            assert got["fragments"] > 1


def test_sdk_stream_helper_accumulates_tool_calls(server: RemoteServer) -> None:
    client = server.openai()
    with client.chat.completions.stream(model=MODEL, messages=QUESTION, tools=TOOLS,
                                        tool_choice=NAMED, seed=9, max_tokens=60) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(final.choices[0].message, num_calls=1)


def test_conversation_with_tool_calls_and_results(server: RemoteServer, tokenizer) -> None:
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_abc", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "18 C, sunny"}]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 4,
            "temperature": 0}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    request = ChatCompletionRequest.model_validate(body)
    plan = plan_output(request, tokenizer.chat_template)
    rendered = render_messages(request.messages, plan)
    assert rendered[2:] == [
        {"role": "assistant",
         "content": '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}'},
        {"role": "user", "content": "Result of get_weather (call_abc): 18 C, sunny"}]
    expected = chat_token_ids(tokenizer, rendered)
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def bad(**fields) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 1, **fields}


@pytest.mark.parametrize(("body", "param", "fragment"), [
    (bad(tools=[{"type": "function"}]), "tools.[0].function", "Missing"),
    (bad(tools=[{"type": "retrieval", "function": WEATHER["function"]}]), "tools.[0].type",
     "function"),
    (bad(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools.[0].function.parameters", "expected an object"),
    (bad(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Y"}}}}}]),
     "tools.[0].function.parameters", "not supported"),
    (bad(tools=[WEATHER, WEATHER]), "tools.[1].function.name", "more than one"),
    (bad(tools="get_weather"), "tools", "expected an array"),
    (bad(tool_choice="required"), "tool_choice", "only allowed when 'tools'"),
    (bad(tools=TOOLS, tool_choice="always"), "tool_choice", "Expected"),
    (bad(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", "nope"),
    (bad(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice.function", "Missing"),
    (bad(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls", "boolean"),
    (bad(messages=[{"role": "tool", "content": "x"}]), "messages.[0].tool_call_id",
     "Missing"),
    (bad(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
     "messages.[0].tool_calls", "only messages with role 'assistant'"),
    (bad(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages.[0].tool_calls.[0].function.arguments", "JSON object"),
    (bad(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]),
     "messages.[0].tool_calls.[0].type", "Missing"),
    (bad(functions=[{"name": "f"}]), "functions", "does not support"),
])
def test_bad_tool_shapes_are_400s(server: RemoteServer, body, param, fragment) -> None:
    with server.http() as http:
        error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param, error
    assert fragment in error["message"], error
