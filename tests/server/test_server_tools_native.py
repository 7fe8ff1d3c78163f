"""Tools on a model whose chat template renders them (Hermes/Qwen style): a real server on
a tiny random-weight model that carries such a template. The template gets the tools and
the conversation's calls and results; required calls are still grammar-made; `auto` output
goes through the Hermes parser, streamed and whole alike."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.server import MODEL, RemoteServer, start_server
from helpers.tiny_model import make_tiny_model

from plait.server.constrained.call_parsers import PARSERS
from plait.server.constrained.output_plan import plan_output, render_messages
from plait.server.protocol import ChatCompletionRequest

# A Qwen-2.5-like template, reduced: tools in the system turn, calls as <tool_call> JSON,
# results as a user turn of <tool_response>s.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return calls as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model):
    path = make_tiny_model(tmp_path_factory.mktemp("hermes"), default_model.path)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    server = start_server([str(path), "--served-model-name", MODEL, "--num-kv-blocks", "256"])
    server.wait_healthy()
    yield server
    server.stop()


def test_required_calls_on_a_tool_template(server: RemoteServer) -> None:
    response = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required", n=2, seed=1,
        parallel_tool_calls=False, max_tokens=40)
    for choice in response.choices:
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])


def test_the_template_renders_tools_calls_and_results(server: RemoteServer, tokenizer) -> None:
    body = {"model": MODEL, "tools": [WEATHER], "max_tokens": 1, "messages": [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    request = ChatCompletionRequest.model_validate(body)
    plan = plan_output(request, HERMES_TEMPLATE)
    assert (plan.mode, plan.parser) == ("parser", PARSERS["hermes"])
    text = tokenizer.apply_chat_template(render_messages(request.messages, plan),
                                         tools=plan.template_tools, tokenize=False,
                                         add_generation_prompt=True,
                                         chat_template=HERMES_TEMPLATE)
    assert json.dumps(WEATHER) in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>') in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_auto_output_is_parsed_the_same_streamed_and_whole(server: RemoteServer) -> None:
    client = server.openai()
    args = dict(model=MODEL, messages=QUESTION, tools=[WEATHER], seed=3, max_tokens=24,
                n=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            streamed[choice.index] += choice.delta.content or ""
    for choice in whole.choices:  # random weights: no <tool_call>, so all of it is content
        assert choice.message.tool_calls is None and choice.finish_reason == "length"
        assert streamed[choice.index] == choice.message.content
