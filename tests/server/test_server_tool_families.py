"""The tool-call formats of Mistral, pythonic (Llama 3.2, Gemma 3), Phi-4-mini and Granite:
each parser on exact text (calls, content before them, malformed calls left as content),
detection from the family's template (tests/data/templates/, README there) or
--tool-call-parser, and the chat route end to end on a scripted engine serving SmolLM2's
tokenizer with that template: the prompt shows the tools and past calls, and n=2 choices
read back the same whole and streamed."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.scripted_text import (
    TextCore,
    accumulate,
    is_call_id,
    scripted_client,
    stream_chunks,
    whole_choices,
)
from helpers.tools import expected, reassemble, split

from plait.engine.model_loader import load_tokenizer
from plait.server.constrained.call_parsers import PARSERS, ParsedCall, ParsedOutput, detect_parser
from plait.server.constrained.family_parsers import (
    parse_granite,
    parse_mistral,
    parse_phi4_mini_json,
    parse_pythonic,
)
from plait.server.constrained.output_plan import plan_output
from plait.server.protocol import ChatCompletionRequest
from plait.server.settings import TOOL_CALL_PARSERS, ServerSettings

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
NAMES = frozenset({"get_weather", "get_time"})
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')
CET = ParsedCall("get_time", '{"zone": "CET"}')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


# ------------------------------------------------------------------ parsers on exact text
@pytest.mark.parametrize(("text", "parsed"), [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', ParsedOutput(None, [PARIS, CET])),
    ('Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     ParsedOutput("Checking.", [PARIS])),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     ParsedOutput(None, [PARIS, CET])),
    ('Hm. [TOOL_CALLS]get_weather{"city": "Paris"}\n', ParsedOutput("Hm. ", [PARIS])),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
     ParsedOutput(None, [PARIS])),
])
def test_mistral_both_forms(text, parsed) -> None:
    assert parse_mistral(text, NAMES) == parsed


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]get_date{"day": 1}',  # not a declared tool
    '[TOOL_CALLS]get_weather{"city": "Paris"',  # cut off
    '[TOOL_CALLS]get_weather["Paris"]', '[TOOL_CALLS]get_weather{"city": "Paris"} and more',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": NaN}}]',
    '[TOOL_CALLS]get_weather[CALL_ID][ARGS]{"city": "Paris"}',  # an empty id
    '[TOOL_CALLS]get_weather[ARGS][ARGS]{"city": "Paris"}',
    "no calls here",
])
def test_mistral_malformed_is_content(text) -> None:
    assert parse_mistral(text, NAMES) == ParsedOutput(text, [])


@pytest.mark.parametrize(("text", "parsed"), [
    ('[get_weather(city="Paris"), get_time(zone="CET")]', ParsedOutput(None, [PARIS, CET])),
    ("\n [get_weather(city='Paris')] ", ParsedOutput(None, [PARIS])),
    ("[get_time()]", ParsedOutput(None, [ParsedCall("get_time", "{}")])),
    ('[get_weather(city="Paris", days=(1, -2.5), opts={"a": [True, None]})]', ParsedOutput(
        None, [ParsedCall("get_weather",
                          '{"city": "Paris", "days": [1, -2.5], "opts": {"a": [true, null]}}')])),
])
def test_pythonic_literals(text, parsed) -> None:
    assert parse_pythonic(text, NAMES) == parsed


@pytest.mark.parametrize("text", [
    "[get_weather(city=paris)]",  # a variable, not a literal
    '[get_weather("Paris")]',  # positional
    "[get_weather(city=__import__('os').getcwd())]",  # a call: never evaluated
    "[get_weather(city=1 + 2)]", "[get_weather(**{'city': 'Paris'})]",
    "[get_weather(city={1, 2})]", "[get_weather(city=b'x')]", "[get_weather(city=1e999)]",
    "[get_weather(city='a', city='b')]", "[os.system(cmd='ls')]", "[get_date(day=1)]",
    "[get_weather(city='Paris')", "[1, 2]", "[]", "Sure: [get_weather(city='Paris')]",
])
def test_pythonic_anything_but_literal_calls_is_content(text) -> None:
    assert parse_pythonic(text, NAMES) == ParsedOutput(text, [])


def test_phi4_mini_and_granite() -> None:
    calls = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
            '{"name": "get_time", "parameters": {"zone": "CET"}}]'
    assert parse_phi4_mini_json(f"functools{calls}", NAMES) == ParsedOutput(None, [PARIS, CET])
    assert parse_phi4_mini_json(f"Sure. functools{calls}", NAMES).content == "Sure. "
    one = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parse_granite(f"<|tool_call|>{one}", NAMES) == ParsedOutput(None, [PARIS])
    assert parse_granite(f"Let me see.<tool_call>{one}", NAMES) == ParsedOutput(
        "Let me see.", [PARIS])
    for text in (f"functools{one[:-2]}", "functools[]", f"functools{one} extra",
                 '<|tool_call|>[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
                 "<|tool_call|>", "plain"):
        parse = parse_phi4_mini_json if text.startswith("functools") else parse_granite
        assert parse(text, NAMES) == ParsedOutput(text, [])


# ------------------------------------------------------------------ detection
@pytest.mark.parametrize(("name", "parser"), [
    ("mistral.jinja", "mistral"), ("llama3_2_pythonic.jinja", "pythonic"),
    ("gemma3_pythonic.jinja", "pythonic"), ("phi4_mini.jinja", "phi4_mini_json"),
    ("granite3.jinja", "granite")])
def test_detected_from_the_template(name, parser) -> None:
    assert detect_parser(template(name)) is PARSERS[parser]


def test_granite_is_never_hermes_and_the_flag_overrides(tokenizer) -> None:
    # A Granite template that shows <tool_call> too stays granite; Llama 3.2's pythonic
    # template says "ipython" and stays pythonic.
    granite = template("granite3.jinja") + "{# calls as <tool_call> #}"
    assert detect_parser(granite) is PARSERS["granite"]
    assert "ipython" in template("llama3_2_pythonic.jinja")
    assert detect_parser(tokenizer.chat_template, "pythonic") is PARSERS["pythonic"]
    assert detect_parser(template("granite3.jinja"), "hermes") is PARSERS["hermes"]


def test_required_and_named_use_the_call_grammar() -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "tool_choice": "required"})
    plan = plan_output(body, template("mistral.jinja"))
    assert (plan.mode, plan.spec.kind, plan.parser, plan.native, plan.keep_special) == (
        "calls", "json_schema", PARSERS["json"], True, False)
    auto = plan_output(body.model_copy(update={"tool_choice": "auto"}), template("mistral.jinja"))
    assert (auto.mode, auto.spec, auto.keep_special) == ("parser", None, True)


# ------------------------------------------------------------------ streaming
STREAM_CASES = [
    ("mistral.jinja", 'Ok.[TOOL_CALLS]get_weather{"city": "Paris"}'),
    ("mistral.jinja", "[TOOL_CALLS] broken"),
    ("llama3_2_pythonic.jinja", '[get_weather(city="Paris"), get_time(zone="CET")]'),
    ("llama3_2_pythonic.jinja", "[1] is a footnote"),
    ("phi4_mini.jinja", 'Sure. functools[{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("granite3.jinja", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("granite3.jinja", "Just text, <|tool_ca"),
]


@pytest.mark.parametrize(("name", "text"), STREAM_CASES)
@pytest.mark.parametrize("size", [1, 3, 100])
def test_streamed_deltas_add_up_to_the_whole_message(name, text, size) -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME]})
    plan = plan_output(body, template(name))
    got, reason = reassemble(plan, split(text, size), "stop")
    want, want_reason = expected(plan, text, "stop")
    for call in got["tool_calls"] + want["tool_calls"]:  # Mistral's templates: 9 characters
        assert is_call_id(call_id := call.pop("id"))
        assert (len(call_id) == 9) == (name == "mistral.jinja")
    assert (got, reason) == (want, want_reason)


# ------------------------------------------------------------------ chat route, scripted
FAMILIES = {
    "mistral.jinja": (
        ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]',
         'Let me check.[TOOL_CALLS]get_weather{"city": "Oslo"}'],
        "[AVAILABLE_TOOLS]"),
    "llama3_2_pythonic.jinja": (
        ['[get_weather(city="Paris"), get_time(zone="CET")]', "It is sunny in Oslo."],
        "[func_name1("),
    "gemma3_pythonic.jinja": (
        ['[get_weather(city="Paris"), get_time(zone="CET")]', "It is sunny in Oslo."],
        "python list of the function calls"),
    "phi4_mini.jinja": (
        ['functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]',
         'Let me check.functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'],
        "functools["),
    "granite3.jinja": (
        ['<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]', "It is sunny in Oslo."],
        "<|start_of_role|>available_tools<|end_of_role|>"),
}
BOTH_CALLS = [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
              {"name": "get_time", "arguments": '{"zone": "CET"}'}]


def second_choice(script: str) -> dict:
    if script.endswith("sunny in Oslo."):
        return {"content": script, "tool_calls": [], "finish_reason": "stop"}
    return {"content": "Let me check.", "finish_reason": "tool_calls",
            "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]}


@pytest.fixture(scope="module")
def bare_tokenizer(default_model):
    tokenizer = load_tokenizer(default_model.path)
    tokenizer.chat_template = None
    return tokenizer


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_n2_whole_and_streamed(bare_tokenizer, name) -> None:
    scripts, shown = FAMILIES[name]
    core = TextCore(bare_tokenizer, scripts)
    body = {"model": "scripted-model", "n": 2, "max_tokens": 200, "tools": [WEATHER, TIME],
            "messages": [{"role": "user", "content": "Weather in Paris, and the time?"}]}
    with scripted_client(core, ServerSettings(chat_template=template(name))) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        whole = whole_choices(response.json())
        streamed = accumulate(stream_chunks(http, "/v1/chat/completions", body))
    want = {0: {"content": None, "tool_calls": BOTH_CALLS, "finish_reason": "tool_calls"},
            1: second_choice(scripts[1])}
    for got in (whole, streamed):
        assert {i: {k: c[k] for k in ("content", "tool_calls", "finish_reason")}
                for i, c in got.items()} == want
    prompt = bare_tokenizer.decode(core.prompts[0])
    assert shown in prompt and '"name": "get_weather"' in prompt
    keep = name in ("mistral.jinja", "granite3.jinja")  # their markers are special tokens
    assert [p.skip_special_tokens for p in core.params] == [not keep] * 4


@pytest.mark.parametrize(("name", "past_call"), [
    ("mistral.jinja", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("llama3_2_pythonic.jinja", '[get_weather(city="Paris")]<|eot_id|>'),
    ("gemma3_pythonic.jinja", '<start_of_turn>model\n[get_weather(city="Paris")]'),
    ("phi4_mini.jinja", '<|assistant|>functools[{"name": "get_weather", '
                        '"arguments": {"city": "Paris"}}]<|end|>'),
    ("granite3.jinja", '<|tool_call|>[{"name": "get_weather", '
                       '"arguments": {"city": "Paris"}}]<|end_of_text|>'),
])
def test_past_calls_render_in_the_family_format(bare_tokenizer, name, past_call) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_abcdefghij", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abcdefghij", "content": "18 C"}]
    core = TextCore(bare_tokenizer, ["ok"])
    with scripted_client(core, ServerSettings(chat_template=template(name))) as http:
        response = http.post("/tokenize", json={"messages": messages, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    prompt = bare_tokenizer.decode(response.json()["tokens"])
    assert past_call in prompt and "18 C" in prompt


def test_the_flag_picks_the_parser_over_the_template(bare_tokenizer) -> None:
    core = TextCore(bare_tokenizer, ['[get_weather(city="Paris")]'])
    settings = ServerSettings(chat_template=template("granite3.jinja"),
                              tool_call_parser="pythonic")
    body = {"model": "scripted-model", "max_tokens": 50, "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    with scripted_client(core, settings) as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert core.params[0].skip_special_tokens is True  # pythonic: no special markers


def test_every_named_parser_is_registered() -> None:
    assert set(TOOL_CALL_PARSERS) == set(PARSERS) - {"json"}


def test_json_nested_past_the_recursion_limit_is_content() -> None:
    deep = "[" * 5000 + "]" * 5000
    texts = {"mistral": f"[TOOL_CALLS]get_time{{\"zone\": {deep}}}",
             "phi4_mini_json": f"functools[{deep}]", "granite": f"<|tool_call|>{deep}",
             "pythonic": f"[get_time(zone={deep})]",
             "hermes": f"<tool_call>{{\"name\": \"get_time\", \"arguments\": {deep}}}",
             "llama3_json": f'{{"name": "get_time", "parameters": {{"a": {deep}}}}}',
             "json": deep}
    for name, text in texts.items():
        assert PARSERS[name].parse(text, NAMES) == ParsedOutput(text, []), name
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TIME]})
    plan = plan_output(body, template("phi4_mini.jinja"))
    got, reason = reassemble(plan, split(f'[{{"name": "get_time", "arguments": {deep}}}]', 500),
                             "stop")
    assert (got["tool_calls"], reason) == ([], "stop")
