"""/v1/responses against a real `plait serve` (default model) through the openai SDK.

The Responses route is a translation onto chat: at temperature 0 (or one seed) a response
and the chat completion of the same conversation give the same text and the same number of
prompt tokens. Every event stream passes `check_stream` (order, sequence numbers, deltas
adding up to the final response)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from helpers.responses import check_stream, parse_events
from helpers.server import MODEL, RemoteServer
from pydantic import BaseModel, Field

WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "minLength": 1, "maxLength": 16}},
               "required": ["city"]}}
GREEDY = {"temperature": 0.0}


def raw_stream(server: RemoteServer, **body) -> dict:
    """POST a streaming request; check and return the terminal response."""
    with server.http() as http:
        reply = http.post("/v1/responses", json={"model": MODEL, "stream": True, **body})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    return check_stream(parse_events(reply.content))


def test_create_with_string_input_is_chat_translated(server: RemoteServer) -> None:
    client = server.openai()
    response = client.responses.create(model=MODEL, input="Name a color.",
                                       max_output_tokens=40, metadata={"k": "v"}, **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
        max_completion_tokens=40, **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.error is None
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [(p.type, p.annotations) for p in item.content] == [("output_text", [])]
    assert response.output_text == chat.choices[0].message.content
    done = chat.choices[0].finish_reason == "stop"
    assert (response.status, item.status) == (("completed",) * 2 if done else ("incomplete",) * 2)
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0
    # The request's settings, echoed.
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.0, 1.0, 40)
    assert (response.tool_choice, response.tools, response.parallel_tool_calls) == ("auto", [],
                                                                                    True)
    assert response.text.format.type == "text" and response.metadata == {"k": "v"}
    assert response.store is True and response.previous_response_id is None


def test_item_input_roles_parts_and_instructions(server: RemoteServer) -> None:
    client = server.openai()
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Which planet is red?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Mars."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And the largest?"}]},
    ]
    response = client.responses.create(model=MODEL, input=items, instructions="Be brief.",
                                       max_output_tokens=24, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, max_completion_tokens=24, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Which planet is red?"},
        {"role": "assistant", "content": "Mars."},
        {"role": "user", "content": "And the largest?"}], **GREEDY)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Be brief."


def test_stream_helper_and_raw_events(server: RemoteServer) -> None:
    client = server.openai()
    kwargs = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 60, **GREEDY}
    seen, deltas = [], ""
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            seen.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
        final = stream.get_final_response()
    created = client.responses.create(**kwargs)
    assert seen[:4] == ["response.created", "response.in_progress",
                        "response.output_item.added", "response.content_part.added"]
    assert seen[-4:] == ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
    assert final.status == "completed" and final.output_text == deltas == created.output_text
    assert final.usage.output_tokens == created.usage.output_tokens
    raw = raw_stream(server, input="Say hello.", max_output_tokens=60, **GREEDY)
    assert raw["output"][0]["content"][0]["text"] == created.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored


def test_max_output_tokens_gives_incomplete(server: RemoteServer) -> None:
    client = server.openai()
    response = client.responses.create(model=MODEL, input="Tell me a long story.",
                                       max_output_tokens=3, **GREEDY)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in response.output] == ["incomplete"]
    assert response.usage.output_tokens == 3
    raw = raw_stream(server, input="Tell me a long story.", max_output_tokens=3, **GREEDY)
    assert raw["status"] == "incomplete" and raw["output"][0]["status"] == "incomplete"
    assert raw["output"][0]["content"][0]["text"] == response.output_text


class City(BaseModel):
    name: str = Field(max_length=12)
    population_millions: int = Field(ge=0, le=100)


def test_parse_with_a_pydantic_text_format(server: RemoteServer) -> None:
    client = server.openai()
    parsed = client.responses.parse(model=MODEL, input="Describe Paris as JSON.",
                                    text_format=City, max_output_tokens=60, **GREEDY)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)
    assert parsed.text.format.type == "json_schema"
    raw = raw_stream(server, input="Describe Paris as JSON.", max_output_tokens=60,
                     text={"format": {"type": "json_schema", "name": "City", "strict": True,
                                      "schema": City.model_json_schema()}}, **GREEDY)
    City.model_validate_json(raw["output"][0]["content"][0]["text"])
    obj = client.responses.create(model=MODEL, input="A JSON object about Rome.",
                                  text={"format": {"type": "json_object"}},
                                  max_output_tokens=40, **GREEDY)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_function_call_round_trip(server: RemoteServer) -> None:
    client = server.openai()
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=question, tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=60, **GREEDY)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tool_choice == "required" and first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}
    # The whole conversation sent back, and the same continued by previous_response_id:
    # one prompt, one answer.
    explicit = client.responses.create(
        model=MODEL, input=[*question, *[i.model_dump(exclude_none=True) for i in first.output],
                            result], tools=[WEATHER], tool_choice="none",
        max_output_tokens=30, **GREEDY)
    chained = client.responses.create(model=MODEL, previous_response_id=first.id,
                                      input=[result], tools=[WEATHER], tool_choice="none",
                                      max_output_tokens=30, **GREEDY)
    assert explicit.output[0].type == "message"
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.output_text == explicit.output_text
    assert chained.previous_response_id == first.id
    chat = client.chat.completions.create(
        model=MODEL, max_completion_tokens=30, tool_choice="none", **GREEDY,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}],
        messages=[*question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}])
    assert explicit.usage.input_tokens == chat.usage.prompt_tokens
    assert explicit.output_text == chat.choices[0].message.content


def test_named_tool_choice_streams_arguments(server: RemoteServer) -> None:
    client = server.openai()
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40, **GREEDY) as stream:
        deltas = "".join(e.delta for e in stream
                         if e.type == "response.function_call_arguments.delta")
        helper = stream.get_final_response()
    assert helper.output[0].type == "function_call" and helper.output[0].arguments == deltas
    result = {"type": "function_call_output", "call_id": helper.output[0].call_id,
              "output": "-3 C, snow"}
    chained = client.responses.create(model=MODEL, previous_response_id=helper.id,
                                      input=[result], max_output_tokens=20, **GREEDY)
    explicit = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "Weather in Oslo?"},
                            helper.output[0].model_dump(exclude_none=True), result],
        max_output_tokens=20, **GREEDY)  # a streamed call is stored like a created one
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.output_text == explicit.output_text
    final = raw_stream(server, input="Weather in Oslo?", tools=[WEATHER],
                       tool_choice={"type": "function", "name": "get_weather"},
                       max_output_tokens=40, **GREEDY)
    [call] = final["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["status"] == "completed" and final["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])


def test_auto_tool_choice_stream_matches_non_stream(server: RemoteServer) -> None:
    client = server.openai()
    kwargs = {"input": "Use the tool: what is the weather in Rome?", "tools": [WEATHER],
              "max_output_tokens": 40, **GREEDY}
    whole = client.responses.create(model=MODEL, **kwargs)
    streamed = raw_stream(server, **kwargs)
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
             for item in streamed["output"]]
    assert strip == [{k: v for k, v in item.model_dump(exclude_none=True).items()
                      if k not in ("id", "call_id")} for item in whole.output]


def test_previous_response_id_retrieve_input_items_delete(server: RemoteServer) -> None:
    client = server.openai()
    first = client.responses.create(model=MODEL, input="My name is Ann.",
                                    max_output_tokens=8, **GREEDY)
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="What is my name?", max_output_tokens=8, **GREEDY)
    replay = [{"role": "user", "content": "My name is Ann."},
              *[i.model_dump(exclude_none=True) for i in first.output],
              {"role": "user", "content": "What is my name?"}]
    explicit = client.responses.create(model=MODEL, input=replay, max_output_tokens=8,
                                       **GREEDY)
    assert second.usage.input_tokens == explicit.usage.input_tokens
    assert second.output_text == explicit.output_text

    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    items = client.responses.input_items.list(explicit.id, order="asc", limit=2)
    assert [i.type for i in items.data] == ["message", "message"]
    assert items.data[0].content[0].text == "My name is Ann." and items.has_more
    assert items.first_id == items.data[0].id and items.last_id == items.data[1].id
    rest = client.responses.input_items.list(explicit.id, order="asc", after=items.last_id)
    assert [i.id for i in rest.data] == [i.id for i in reversed(client.responses.input_items
                                                                  .list(explicit.id).data)][2:]
    assert not rest.has_more

    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi")
    with server.http() as http:
        reply = http.delete(f"/v1/responses/{second.id}")
    assert reply.json() == {"id": second.id, "object": "response.deleted", "deleted": True}


def test_store_false_keeps_nothing(server: RemoteServer) -> None:
    client = server.openai()
    response = client.responses.create(model=MODEL, input="Hi", store=False,
                                       max_output_tokens=4)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_n3_message_items_one_prompt(server: RemoteServer) -> None:
    client = server.openai()
    kwargs = {"max_output_tokens": 12, "temperature": 1.0}
    response = client.responses.create(model=MODEL, input="Name an animal.",
                                       extra_body={"n": 3, "seed": 7}, **kwargs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name an animal."}], n=3, seed=7,
        max_completion_tokens=12, temperature=1.0)
    texts = [item.content[0].text for item in response.output]
    assert [item.type for item in response.output] == ["message"] * 3
    assert texts == [c.message.content for c in chat.choices]
    assert response.output_text == "".join(texts)
    assert response.usage.input_tokens == chat.usage.prompt_tokens  # the prompt once
    final = raw_stream(server, input="Name an animal.", n=3, seed=7, **kwargs)
    assert [i["content"][0]["text"] for i in final["output"]] == texts
    with client.responses.stream(model=MODEL, input="Name an animal.",
                                 extra_body={"n": 3, "seed": 7}, **kwargs) as stream:
        kinds = [event.type for event in stream]  # the SDK's helper accepts n items
    assert kinds.count("response.output_item.added") == 3
    assert kinds[-1] == f"response.{response.status}"


def test_logprobs_included(server: RemoteServer) -> None:
    client = server.openai()
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5,
                                       top_logprobs=2,
                                       include=["message.output_text.logprobs"], **GREEDY)
    part = response.output[0].content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    final = raw_stream(server, input="Hi", max_output_tokens=5, top_logprobs=2,
                       include=["message.output_text.logprobs"], **GREEDY)
    assert [lp["token"] for lp in final["output"][0]["content"][0]["logprobs"]] == \
        [lp.token for lp in part.logprobs]
