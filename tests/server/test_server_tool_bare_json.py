"""tool_choice "auto": an answer that is nothing but call JSON written without the model's
markers (bare, fenced, a list; what small models write) is read as tool calls when it names
declared tools with schema-valid arguments, streamed and whole alike; anything else stays
content, unchanged. Units of the detector and of schema_check.is_valid (against jsonschema),
the streaming hold-back, and the chat route end to end on a scripted engine (exact text) and
on the real default model (a grammar makes it write a call with string arguments)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from helpers.responses import check_stream, parse_events
from helpers.scripted import ScriptedCore, scripted_engine
from helpers.scripted_text import accumulate, whole_choices
from helpers.server import (
    MODEL,
    InProcessServer,
    RemoteServer,
    parse_sse,
    wait_for,
)
from helpers.tools import HERMES_TEMPLATE, expected, reassemble, split

from plait.engine.model_loader import load_tokenizer
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams
from plait.server.app import create_app
from plait.server.constrained.call_parsers import BareCalls, ParsedCall
from plait.server.constrained.output_plan import plan_output
from plait.server.constrained.output_reader import ChoiceStream, choice_message
from plait.server.constrained.schema_check import is_valid
from plait.server.protocol import ChatCompletionRequest
from plait.server.settings import ServerSettings

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city"], "additionalProperties": False,
    "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: {} only
BARE = BareCalls({"get_weather": PARAMS, "ping": {"type": "object", "properties": {}}}, True)
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


# ------------------------------------------------------------------ the detector
@pytest.mark.parametrize(("text", "calls"), [
    (CALL, [PARIS]),
    (f"\n  {CALL}\n", [PARIS]),
    (f"```json\n{CALL}\n```", [PARIS]),
    (f"```\n{CALL}\n```\n", [PARIS]),
    (f"```JSON\n[{CALL}]```", [PARIS]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', [PARIS]),
    ('{"arguments": {"city": "Paris"}, "name": "get_weather"}', [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    (f'[{CALL}, {{"name": "ping", "arguments": {{}}}}]', [PARIS, ParsedCall("ping", "{}")]),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
     [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
])
def test_bare_call_json_is_read_as_calls(text: str, calls: list[ParsedCall]) -> None:
    assert BARE.parse(text) == calls


@pytest.mark.parametrize("text", [
    '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}',  # not a declared tool
    '{"name": "get_weather", "arguments": {"city": 75}}',  # schema-invalid arguments
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # no "city"; closed object
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',  # $ref enum
    '{"name": "get_weather", "arguments": "Paris"}',  # a string that is not an object
    '{"name": "get_weather", "arguments": ["Paris"]}',
    '{"name": "get_weather"}',
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "1"}',  # another key
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "parameters": {}}',
    '{"name": ["get_weather"], "arguments": {}}',
    f"The call is {CALL}",  # prose around JSON
    f"{CALL}\nThat is the call.",
    f"```python\n{CALL}\n```",
    f"```json\n{CALL}\n```\nDone.",
    f"```json\n{CALL}",  # fence not closed
    f"{CALL}{CALL}",
    CALL[:-7],  # cut short
    "[]",
    '{"name": "get_weather", "arguments": {"city": NaN}}',
    "Just text.",
    "",
])
def test_anything_else_is_not_a_call(text: str) -> None:
    assert BARE.parse(text) is None


def test_one_call_only_without_parallel_calls() -> None:
    single = BareCalls(BARE.schemas, parallel=False)
    assert single.parse(f"[{CALL}]") == [PARIS]
    assert single.parse(f"[{CALL}, {CALL}]") is None


def test_possible_turns_false_as_soon_as_the_answer_cannot_be_calls() -> None:
    for text in ("", "  \n", "`", "``", "```js", "```json\n", "{", '{"na', "[", "[{",
                 CALL, f"{CALL}\n", f"```json\n{CALL}\n``", f"```json\n{CALL}\n```",
                 '{"name": "nope", "argum'):  # broken or foreign JSON: found out at the end
        assert BARE.possible(text), text
    for text in ("Sure", " x", "`ls`", "```python", "```\nprint", "{x", "[1", "{}", "[]",
                 f"{CALL} and", f"```json\n{CALL}\n```\nok",
                 '{"name": "nope", "arguments": {}}'):
        assert not BARE.possible(text), text


# ------------------------------------------------------------------ schema_check.is_valid
SCHEMA_CASES = [
    ({"type": "integer"}, [1, 1.0, 1.5, True, "1"]),
    ({"type": ["string", "null"]}, ["a", None, 0]),
    ({"enum": [1, "a", None]}, [1, 1.0, True, "a", None, "b"]),
    ({"const": False}, [False, 0, None]),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
      "additionalProperties": {"type": "integer"}}, [{"a": "x"}, {"a": "x", "b": 1},
                                                      {"a": "x", "b": "y"}, {}, {"a": 1}]),
    ({"patternProperties": {"^x_": {"type": "number"}}, "additionalProperties": False,
      "minProperties": 1}, [{"x_a": 1}, {"x_a": "1"}, {"y": 1}, {}]),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"},
      "minItems": 1, "maxItems": 3, "uniqueItems": True},
     [["a"], ["a", 1, 2], ["a", 1, 1], [1], [], ["a", 1, 2, 3], ["a", True, 1]]),
    ({"type": "string", "minLength": 2, "maxLength": 3, "pattern": "^[a-z]+$"},
     ["ab", "abcd", "a", "AB", "ab1"]),
    ({"type": "number", "minimum": 0, "exclusiveMaximum": 10, "multipleOf": 0.5},
     [0, 9.5, 10, -0.5, 0.25, 3]),
    ({"type": "integer", "exclusiveMinimum": 0, "maximum": 10 ** 20, "multipleOf": 3},
     [3, 0, 10 ** 20 - 2, 10 ** 20 + 1, 4]),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, ["a", 1, 1.5]),
    ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, [-1, 1, 0.5, -0.5]),
    ({"allOf": [{"minimum": 0}, {"maximum": 1}], "not": {"const": 0.5}}, [0, 0.5, 2]),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                      "additionalProperties": False}}, "$ref": "#/$defs/n"},
     [{}, {"next": {"next": {}}}, {"next": {"x": 1}}]),
    ({"type": "object", "title": "T", "description": "d", "x-extra": 1,
      "properties": {"d": {"type": "string", "format": "date", "default": "x"}}},
     [{"d": "not a date"}, {"d": 1}]),
]


@pytest.mark.parametrize(("schema", "values"), SCHEMA_CASES)
def test_schema_check_agrees_with_jsonschema(schema: dict, values: list) -> None:
    reference = jsonschema.Draft202012Validator(schema)
    assert [is_valid(v, schema) for v in values] == [reference.is_valid(v) for v in values]


def test_schema_check_says_invalid_for_keywords_it_does_not_know() -> None:
    for schema in ({"if": {"type": "string"}, "then": {"minLength": 1}},
                   {"$ref": "https://example.com/s.json"}, {"items": [{"type": "string"}]},
                   {"dependentRequired": {"a": ["b"]}}, {"exclusiveMinimum": True}):
        assert not is_valid({"a": 1}, schema) and not is_valid(["x"], schema)


# ------------------------------------------------------------------ plans and messages
def test_only_auto_plans_read_bare_calls() -> None:
    for template in (None, HERMES_TEMPLATE):
        auto = plan_output(request(tools=[WEATHER]), template)
        assert auto.bare == BareCalls({"get_weather": PARAMS}, True)
        assert plan_output(request(tools=[WEATHER], parallel_tool_calls=False),
                           template).bare == BareCalls({"get_weather": PARAMS}, False)
        for choice in ("none", "required",
                       {"type": "function", "function": {"name": "get_weather"}}):
            assert plan_output(request(tools=[WEATHER], tool_choice=choice),
                               template).bare is None
        assert plan_output(request(), template).bare is None


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE])
def test_whole_message_of_a_bare_call(template) -> None:
    plan = plan_output(request(tools=[WEATHER, PING]), template)
    text = f"```json\n{CALL}\n```"
    message, reason = choice_message(plan, text, "stop")
    assert (message["content"], reason) == (None, "tool_calls")
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    # The same text cut by max_tokens is not known to be the whole answer: content.
    assert choice_message(plan, text, "length") == (
        {"role": "assistant", "content": text, "refusal": None}, "length")


def test_the_template_parser_keeps_priority() -> None:
    plan = plan_output(request(tools=[WEATHER, PING]), HERMES_TEMPLATE)
    text = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    message, reason = choice_message(plan, text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["ping"]
    assert reason == "tool_calls"


# ------------------------------------------------------------------ streaming
STREAM_TEXTS = [
    CALL, f" ```json\n[{CALL}]\n```\n", '{"name": "ping", "arguments": "{}"}',
    f"```json\n{CALL}\n```\nThat was it.", f"{CALL} is how to call it",
    '{"name": "get_weather", "arguments": {"city": ""}}', "[1, 2, 3] are numbers",
    "Plain text {not json}", "`code` and text", "\n\n",
]


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE])
@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("size", [1, 4, 100])
def test_streamed_deltas_reassemble_to_the_whole_message(template, text, size) -> None:
    plan = plan_output(request(tools=[WEATHER, PING]), template)
    for finish in ("stop", "length"):
        got, reason = reassemble(plan, split(text, size), finish)
        want, want_reason = expected(plan, text, finish)
        for call in got["tool_calls"] + want["tool_calls"]:
            assert call.pop("id").startswith("call_")
        assert (got, reason) == (want, want_reason)
        if finish == "stop" and template is not None:  # json: the grammar's own parser
            assert bool(want["tool_calls"]) == (text in STREAM_TEXTS[:3])


def test_text_that_cannot_be_a_call_is_never_held() -> None:
    stream = ChoiceStream(plan_output(request(tools=[WEATHER]), HERMES_TEMPLATE))
    assert stream.feed("Sun", []) == [({"content": "Sun"}, [])]
    stream = ChoiceStream(plan_output(request(tools=[WEATHER]), HERMES_TEMPLATE))
    assert stream.feed("[", []) == []
    assert stream.feed("1, 2]", []) == [({"content": "[1, 2]"}, [])]


def test_held_json_goes_out_the_moment_more_text_follows_it() -> None:
    stream = ChoiceStream(plan_output(request(tools=[WEATHER]), HERMES_TEMPLATE))
    pieces = [stream.feed(p, []) for p in ("```json\n", CALL, "\n```", "\n")]
    assert pieces == [[]] * 4
    assert stream.feed("Now I", []) == [({"content": f"```json\n{CALL}\n```\nNow I"}, [])]
    assert stream.finish("stop") == ([], "stop")


# ------------------------------------------------------------------ chat route, scripted
class TextCore(ScriptedCore):
    """Sub-request k (in the order they are added) writes `scripts[k % len]` token by token
    and finishes with "stop" (or "length" at its max_tokens)."""

    def __init__(self, tokenizer, scripts: list[str]) -> None:
        super().__init__(tokenizer)
        self.scripts = [tokenizer.encode(s, add_special_tokens=False) for s in scripts]
        self.tokens: dict[str, list[int]] = {}

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        super().add_request(request_id, prompt_token_ids, params)
        with self.lock:
            self.tokens[request_id] = self.scripts[len(self.tokens) % len(self.scripts)]

    def next_delta(self, request_id: str, params: SamplingParams, done: int) -> RequestDelta:
        script = self.tokens[request_id]
        token = script[done]
        delta = RequestDelta(request_id, [token], self.tokenizer.decode([token]),
                             num_prompt_tokens=3)
        if done + 1 == len(script):
            delta.finish_reason = "stop"
        elif done + 1 >= (params.max_tokens or 64):
            delta.finish_reason = "length"
        return delta


@pytest.fixture(scope="module")
def hermes_tokenizer(default_model):
    tokenizer = load_tokenizer(default_model.path)  # its own copy: the template changes
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def chat(core: TextCore, body: dict, paced: int | None = None) -> tuple[dict, list[dict]]:
    """The whole response and the stream's chunks for `body` on a scripted app. `paced`: the
    stream runs one step per content chunk of that choice (so no two of its tokens merge
    into one chunk) until the choice finished, then freely."""
    app = create_app(ServerSettings(), engine=scripted_engine(core))
    with InProcessServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        whole = http.post("/v1/chat/completions", json=body)
        if paced is not None:
            core.hold()
            core.release(1)
        lines = []
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as (
                streamed):
            assert streamed.status_code == 200, streamed.read()
            for line in streamed.iter_lines():
                lines.append(line)
                if paced is not None and line.startswith("data: {"):
                    pace(core, json.loads(line[len("data: "):]), paced)
    assert whole.status_code == 200, whole.text
    return whole.json(), parse_sse(("\n".join(lines) + "\n").encode()).chunks


def pace(core: TextCore, chunk: dict, index: int) -> None:
    for choice in chunk["choices"]:
        if choice["index"] != index:
            continue
        if choice["finish_reason"] is not None:
            core.run_freely()
        elif choice["delta"].get("content"):
            core.release(1)


@pytest.mark.parametrize("hermes", [True, False])
def test_chat_route_reads_bare_calls_per_choice(hermes: bool, tokenizer,
                                                hermes_tokenizer) -> None:
    scripts = [f"```json\n{CALL}\n```", "It is sunny in Paris."]
    core = TextCore(hermes_tokenizer if hermes else tokenizer, scripts)
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "Paris?"}],
            "tools": [WEATHER], "n": 2}
    whole, chunks = chat(core, body, paced=1)
    # no reasoning parser: the reasoning fields are never sent
    none = {"reasoning_content": None, "reasoning": None}
    want = {0: {"content": None, "finish_reason": "tool_calls", "tool_calls": [
                {"name": "get_weather", "arguments": '{"city": "Paris"}'}], **none},
            1: {"content": "It is sunny in Paris.", "finish_reason": "stop",
                "tool_calls": [], **none}}
    assert whole_choices(whole) == want
    assert accumulate(chunks) == want
    # The call's text never went out as content; the plain answer streamed token by token.
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks
              if c.get("choices") and c["choices"][0]["index"] == 1]
    tokens = core.tokenizer.encode(scripts[1], add_special_tokens=False)
    assert [p for p in pieces if p] == [core.tokenizer.decode([t]) for t in tokens]


def test_chat_route_leaves_a_call_cut_by_max_tokens_as_content(hermes_tokenizer) -> None:
    core = TextCore(hermes_tokenizer, [CALL])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "Paris?"}],
            "tools": [WEATHER], "max_tokens": 6}
    whole, chunks = chat(core, body)
    [choice] = whole_choices(whole).values()
    assert choice["finish_reason"] == "length" and not choice["tool_calls"]
    assert CALL.startswith(choice["content"]) and choice["content"] != CALL
    assert accumulate(chunks) == {0: choice}


# ------------------------------------------------------------------ the real default model

def test_default_model_call_with_string_arguments(server: RemoteServer, tokenizer) -> None:
    """With response_format, tool_choice auto is "the answer's schema | calls" (an array of
    calls, with parallel calls). The answer's schema below admits only a call whose
    arguments are a JSON string, which the grammar's call branch cannot make: before bare
    calls, it came back as content."""
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    answer = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                               "arguments": {"const": arguments}},
              "required": ["name", "arguments"]}
    brace = {str(tokenizer.convert_tokens_to_ids(t)): 100 for t in ("{", '{"')}
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[WEATHER], temperature=0, max_tokens=60, logit_bias=brace,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "call", "schema": answer}})
    client = server.openai()
    whole = client.chat.completions.create(**args).choices[0]
    assert (whole.finish_reason, whole.message.content) == ("tool_calls", None)
    [call] = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"})
    calls, content, finish = [], None, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            content = (content or "") + choice.delta.content if choice.delta.content else content
            calls += [(c.function.name, c.function.arguments)
                      for c in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    assert (calls, content, finish) == ([(call.function.name, call.function.arguments)], None,
                                        "tool_calls")


def test_responses_route_reads_a_bare_call_too(hermes_tokenizer) -> None:
    """/v1/responses runs chat's tool-output stage: a fenced bare call is a function_call
    item, whole and streamed, and its text never goes out as output_text."""
    core = TextCore(hermes_tokenizer, [f"```json\n{CALL}\n```"])
    body = {"model": "scripted-model", "input": "Paris?", "store": False,
            "tools": [{"type": "function", **WEATHER["function"]}]}
    app = create_app(ServerSettings(), engine=scripted_engine(core))
    with InProcessServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert wait_for(lambda: http.get("/health").status_code == 200, 30)
        whole = http.post("/v1/responses", json=body)
        streamed = http.post("/v1/responses", json={**body, "stream": True})
    assert whole.status_code == 200 and streamed.status_code == 200, whole.text
    events = parse_events(streamed.content)
    final = check_stream(events)
    for response in (whole.json(), final):
        assert response["status"] == "completed"
        [item] = response["output"]
        assert (item["type"], item["name"], json.loads(item["arguments"]), item["status"]) \
            == ("function_call", "get_weather", {"city": "Paris"}, "completed")
    assert not [e for e in events if e["type"].startswith("response.output_text")]
