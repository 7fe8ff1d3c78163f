"""Tool calling and structured output without a server: parsers, the streaming delta logic,
conversation rendering, and the grammars (checked with llguidance on the default tokenizer)."""

from __future__ import annotations

import json

import pytest
from helpers.tools import HERMES_TEMPLATE, expected, reassemble, split

from plait.engine.structured import grammar_text
from plait.server.constrained.call_parsers import (
    PARSERS,
    ParsedCall,
    ParsedOutput,
    detect_parser,
    parse_hermes,
    parse_json,
    parse_llama3_json,
)
from plait.server.constrained.grammars import auto_spec, close_objects, named_spec, required_spec
from plait.server.constrained.output_plan import plan_output, render_messages
from plait.server.constrained.output_reader import ChoiceStream
from plait.server.constrained.request_fields import parse_tools
from plait.server.errors import APIError
from plait.server.protocol import ChatCompletionRequest, ChatMessage

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"], "$defs": {"Unit": {"enum": ["c", "f"]}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
NAMES = frozenset({"get_weather", "add"})


# ------------------------------------------------------------------ parsers
def test_hermes_parser_content_then_calls() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1}}')
    assert parse_hermes(text, NAMES) == ParsedOutput("Let me check.\n", [
        ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("add", '{"a": 1}')])
    unknown = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert parse_hermes(unknown, NAMES) == ParsedOutput(unknown, [])
    assert parse_hermes("plain", NAMES) == ParsedOutput("plain", [])
    broken = '<tool_call>{"name": "add", "argu'
    assert parse_hermes(broken, NAMES) == ParsedOutput(broken, [])


def test_llama3_json_parser() -> None:
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 2}}; '
            '{"name": "add", "parameters": {"a": 3}}')
    assert parse_llama3_json(text, NAMES) == ParsedOutput(None, [
        ParsedCall("add", '{"a": 2}'), ParsedCall("add", '{"a": 3}')])
    assert parse_llama3_json('{"name": "add"}', NAMES).calls == []
    assert parse_llama3_json("Hi {x}", NAMES) == ParsedOutput("Hi {x}", [])


def test_json_parser_object_array_and_text() -> None:
    call = '{"name":"add","arguments":{"a":1}}'
    assert parse_json(call, NAMES) == ParsedOutput(None, [ParsedCall("add", '{"a": 1}')])
    assert parse_json(f"[{call},{call}]", NAMES).calls == [ParsedCall("add", '{"a": 1}')] * 2
    assert parse_json(call[:-3], NAMES) == ParsedOutput(call[:-3], [])
    assert parse_json("  ", NAMES) == ParsedOutput(None, [])
    assert parse_json("[]", NAMES) == ParsedOutput("[]", [])


def test_detect_parser_by_template(tokenizer) -> None:
    assert detect_parser(HERMES_TEMPLATE) is PARSERS["hermes"]
    assert detect_parser("{% if tools %}<|python_tag|>{% endif %}") is PARSERS["llama3_json"]
    assert detect_parser(tokenizer.chat_template) is None  # SmolLM2: no tool format
    assert detect_parser(None) is None


# ------------------------------------------------------------------ plans and messages
def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_plan_modes_for_a_template_without_tools(tokenizer) -> None:
    template = tokenizer.chat_template
    assert plan_output(request(), template).mode == "text"
    assert plan_output(request(tools=[ADD], tool_choice="none"), template).spec is None
    required = plan_output(request(tools=[ADD], tool_choice="required"), template)
    assert (required.mode, required.forced, required.spec.kind) == ("calls", True, "json_schema")
    named = plan_output(request(tools=[ADD, WEATHER], tool_choice={
        "type": "function", "function": {"name": "add"}}), template)
    assert (named.mode, named.named, named.forced) == ("named", "add", True)
    auto = plan_output(request(tools=[ADD]), template)
    assert (auto.mode, auto.forced, auto.spec.kind) == ("calls", False, "lark")
    assert "Otherwise answer in plain text" in auto.system_text


def test_plan_auto_with_a_hermes_template_parses_unconstrained() -> None:
    plan = plan_output(request(tools=[ADD]), HERMES_TEMPLATE)
    assert (plan.mode, plan.spec, plan.parser, plan.native) == ("parser", None,
                                                                 PARSERS["hermes"], True)
    assert plan.template_tools == [ADD]
    none = plan_output(request(tools=[ADD], tool_choice="none"), HERMES_TEMPLATE)
    assert (none.mode, none.spec, none.template_tools) == ("text", None, [ADD])


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [ADD, ADD]}, "tools.[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}]},
     "tools.[0].function.parameters"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_plan_errors_name_the_parameter(fields, param) -> None:
    with pytest.raises(APIError) as info:
        plan_output(request(**fields), None)
    assert (info.value.status, info.value.param) == (400, param)


def conversation() -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather in Oslo and 1+1?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}},
            {"id": "call_2", "type": "function", "function": {
                "name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "2"}]},
    ]]


def test_render_without_tool_support_uses_the_grammar_format(tokenizer) -> None:
    plan = plan_output(request(tools=[ADD, WEATHER]), tokenizer.chat_template)
    messages = render_messages(conversation(), plan)
    assert messages[0]["role"] == "system" and messages[0]["content"] == plan.system_text
    assert messages[1:] == [
        {"role": "user", "content": "Weather in Oslo and 1+1?"},
        {"role": "assistant", "content": '[{"name":"get_weather","arguments":{"city":"Oslo",'
                                         '"unit":"c"}},{"name":"add","arguments":{"a":1}}]'},
        {"role": "user", "content": "Result of get_weather (call_1): -3 C\n"
                                    "Result of add (call_2): 2"}]


def test_render_for_a_tool_template_passes_dict_arguments(tokenizer) -> None:
    plan = plan_output(request(tools=[ADD, WEATHER]), HERMES_TEMPLATE)
    messages = render_messages(conversation(), plan)
    assert messages[1]["tool_calls"][0] == {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                           "content": "-3 C"}
    text = tokenizer.apply_chat_template(messages, tools=plan.template_tools, tokenize=False,
                                         chat_template=HERMES_TEMPLATE)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text
    assert '"name": "get_weather"' in text.splitlines()[1]  # the tool list, from the template


# ------------------------------------------------------------------ streaming == whole
@pytest.mark.parametrize(("template", "choice", "text"), [
    (None, "auto", '{"name":"add","arguments":{"a":7}}'),
    (None, "auto", "  Just text {with braces}"),
    (None, "required", '[{"name":"add","arguments":{"a":1}},{"name":"add","arguments":{"a":2}}]'),
    (None, "required", '[{"name":"add","argu'),  # cut by length: content
    (None, {"type": "function", "function": {"name": "add"}}, '{"a":12}'),
    (HERMES_TEMPLATE, "auto", 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n'
                              '</tool_call><tool_call>{"name": "add", "arguments": {"a": 4}}'),
    (HERMES_TEMPLATE, "auto", "No calls here, only <tool_ text."),
    (HERMES_TEMPLATE, "auto", '\n <tool_call>{"name": "add", "arguments": {"a": 5}}</tool_call>'),
    (HERMES_TEMPLATE, "auto", "\n  \n"),
])
@pytest.mark.parametrize("size", [1, 3, 50])
def test_streamed_deltas_reassemble_to_the_whole_message(template, choice, text, size) -> None:
    plan = plan_output(request(tools=[ADD], tool_choice=choice), template)
    for finish in ("stop", "length"):
        got, reason = reassemble(plan, split(text, size), finish)
        want, want_reason = expected(plan, text, finish)
        ids = [c.pop("id") for c in got["tool_calls"]] + [c.pop("id") for c in want["tool_calls"]]
        assert all(i.startswith("call_") and len(i) == 29 for i in ids)
        assert (got, reason) == (want, want_reason)
        assert reason == ("tool_calls" if want["tool_calls"] and finish == "stop" else finish)


def test_hermes_stream_holds_back_a_partial_marker_only() -> None:
    plan = plan_output(request(tools=[ADD]), HERMES_TEMPLATE)
    stream = ChoiceStream(plan)
    assert stream.feed("Hi <tool", []) == [({"content": "Hi "}, [])]
    assert stream.feed("s are fun", []) == [({"content": "<tools are fun"}, [])]


# ------------------------------------------------------------------ grammars
@pytest.fixture(scope="module")
def accepts(tokenizer):
    import llguidance.hf
    from llguidance import LLMatcher

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def check(spec, text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar_text(spec), log_level=0)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and not matcher.is_error() and matcher.is_accepting()
    return check


def test_auto_grammar_is_text_or_a_valid_call(accepts) -> None:
    spec = auto_spec(parse_tools([WEATHER, ADD]), parallel=False)
    assert accepts(spec, "Hello there.\nBye")
    assert accepts(spec, '{"name":"get_weather","arguments":{"city":"Oslo","unit":"f"}}')
    assert not accepts(spec, '{"name":"get_weather","arguments":{"city":"Oslo","unit":"k"}}')
    assert not accepts(spec, '{"name":"add","arguments":{"city":"Oslo"}}')
    assert not accepts(spec, ' {"name":"add","arguments":{"a":1}}')  # no hidden JSON
    assert not accepts(spec, "")
    answer = named_spec(parse_tools([ADD]), "add")
    with_answer = auto_spec(parse_tools([ADD]), parallel=False, answer=answer)
    assert accepts(with_answer, '{"a":5}') and not accepts(with_answer, "text")


def test_required_grammar_arrays_only_when_parallel(accepts) -> None:
    tools = parse_tools([WEATHER, ADD])
    two = '[{"name":"add","arguments":{"a":1}},{"name":"add","arguments":{"a":2}}]'
    assert accepts(required_spec(tools, parallel=True), two)
    assert not accepts(required_spec(tools, parallel=True), "[]")
    assert not accepts(required_spec(tools, parallel=False), two)
    assert accepts(required_spec(tools, parallel=False), '{"name":"add","arguments":{"a":1}}')
    # compact: no whitespace between JSON tokens
    spaced = '{"name": "add", "arguments": {"a": 1}}'
    assert not accepts(required_spec(tools, parallel=False), spaced)


def test_named_grammar_keeps_refs(accepts) -> None:
    spec = named_spec(parse_tools([WEATHER]), "get_weather")
    assert json.loads(spec.value)["x-guidance"] == {"whitespace_flexible": False,
                                                    "whitespace_pattern": None}
    assert accepts(spec, '{"city":"Oslo","unit":"c"}')
    assert not accepts(spec, '{"city":"Oslo","unit":"x"}')


def test_schemas_are_closed_where_they_say_nothing_about_other_keys(accepts) -> None:
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"b": {"const": {"properties": {}}}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "both": {"allOf": [{"properties": {"x": {}}}]}}}
    assert close_objects(schema) == {"type": "object", "additionalProperties": False,
                                     "properties": {
        "properties": {"type": "object", "properties": {"b": {"const": {"properties": {}}}},
                       "additionalProperties": False},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "both": {"allOf": [{"properties": {"x": {}}}]}}}
    spec = named_spec(parse_tools([ADD]), "add")
    assert accepts(spec, '{"a":1}') and not accepts(spec, '{"a":1,"b":2}')


COMBINED_SCHEMAS = [  # closing any of these nodes would forbid keys the schema needs
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
     '{"b":1}'),
    ({"type": "object", "properties": {"kind": {"enum": ["x", "y"]}}, "required": ["kind"],
      "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
     '{"kind":"x","x":1}'),
    ({"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}},
                         "required": ["id"]}},
      "$ref": "#/$defs/base", "properties": {"name": {"type": "string"}},
      "required": ["name"]},
     '{"id":1,"name":"a"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "allOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     '{"b":2}'),
]


@pytest.mark.parametrize("schema,valid", COMBINED_SCHEMAS)
def test_combined_schemas_stay_satisfiable_and_named_tools_check_them(accepts, schema,
                                                                      valid) -> None:
    """A node combined with others on the same instance is never closed (nor a schema that
    closing would make unsatisfiable), so a valid output stays possible;
    a named tool's schema is checked like the others (a 400 naming it, never a 500)."""
    import jsonschema

    jsonschema.validate(json.loads(valid), schema)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    spec = named_spec(parse_tools([tool]), "f")
    assert accepts(spec, valid)


def test_a_named_tool_whose_schema_cannot_compile_is_a_400() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}
    with pytest.raises(APIError) as err:
        named_spec(parse_tools([tool]), "f")
    assert err.value.status == 400
    assert err.value.param == "tools.[0].function.parameters"
