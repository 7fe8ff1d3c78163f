"""--reasoning-parser end to end on a scripted engine: <think> text goes to
`reasoning_content` and `reasoning` (message and stream deltas), each of n choices on its
own; tool calls are read from the text after </think> only; chat_template_kwargs turn
Qwen3's thinking off; the Responses API gets a reasoning item (whole and streamed) and
takes it back as input."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.responses import parse_events
from helpers.scripted_text import (
    TextCore,
    accumulate,
    scripted_client,
    stream_chunks,
    whole_choices,
)

from plait.engine.model_loader import load_tokenizer
from plait.server.settings import ServerSettings

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
R1 = (TEMPLATES / "deepseek_r1.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls", "finish_reason")


@pytest.fixture(scope="module")
def bare_tokenizer(default_model):
    tokenizer = load_tokenizer(default_model.path)
    tokenizer.chat_template = None
    return tokenizer


def run_chat(tokenizer, scripts: list[str], settings: ServerSettings,
             **fields) -> tuple[dict, dict, TextCore]:
    """Whole and streamed choices (the FIELDS of each) of one chat body."""
    core = TextCore(tokenizer, scripts)
    body = {"model": "scripted-model", "messages": QUESTION, "max_tokens": 200,
            "n": len(scripts), **fields}
    with scripted_client(core, settings) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        whole = whole_choices(response.json())
        streamed = accumulate(stream_chunks(http, "/v1/chat/completions", body))
    pick = lambda choices: {i: {k: c[k] for k in FIELDS} for i, c in choices.items()}  # noqa: E731
    return pick(whole), pick(streamed), core


def choice(content, reasoning=None, tool_calls=(), finish="stop") -> dict:
    return {"content": content, "reasoning_content": reasoning, "reasoning": reasoning,
            "tool_calls": list(tool_calls), "finish_reason": finish}


def test_qwen3_n2_each_choice_split_on_its_own(bare_tokenizer) -> None:
    whole, streamed, _ = run_chat(
        bare_tokenizer, ["<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny.",
                         "It is sunny."],
        ServerSettings(chat_template=QWEN3, reasoning_parser="qwen3"))
    want = {0: choice("It is sunny.", "\nThe user asks about Paris.\n"),
            1: choice("It is sunny.")}
    assert whole == want and streamed == want


def test_tool_calls_are_read_after_the_reasoning(bare_tokenizer) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    whole, streamed, core = run_chat(
        bare_tokenizer, [f"<think>I need the weather.</think>\n\n{call}",
                         f"<think>No: {call}?</think>Ask me again."],
        ServerSettings(chat_template=QWEN3, reasoning_parser="qwen3"), tools=[WEATHER])
    want = {0: choice(None, "I need the weather.", finish="tool_calls", tool_calls=[
                {"name": "get_weather", "arguments": '{"city": "Paris"}'}]),
            1: choice("Ask me again.", f"No: {call}?")}
    assert whole == want and streamed == want
    assert "<tools>" in bare_tokenizer.decode(core.prompts[0])  # hermes: the template's tools


def test_deepseek_r1_starts_inside_the_reasoning(bare_tokenizer) -> None:
    whole, streamed, core = run_chat(
        bare_tokenizer, ["A greeting.</think>\n\nHello!", "Still thinking when cut"],
        ServerSettings(chat_template=R1, reasoning_parser="deepseek_r1"))
    want = {0: choice("Hello!", "A greeting."), 1: choice(None, "Still thinking when cut")}
    assert whole == want and streamed == want
    assert bare_tokenizer.decode(core.prompts[0]).endswith("<｜Assistant｜><think>\n")


def test_enable_thinking_false_closes_the_block_in_the_prompt(bare_tokenizer) -> None:
    whole, streamed, core = run_chat(
        bare_tokenizer, ["Sunny."], ServerSettings(chat_template=QWEN3, reasoning_parser="qwen3"),
        chat_template_kwargs={"enable_thinking": False})
    assert whole == streamed == {0: choice("Sunny.")}
    prompt = bare_tokenizer.decode(core.prompts[0])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_sent_back_reaches_the_template(bare_tokenizer) -> None:
    """Qwen3 shows the reasoning of the turn after the last user message (a tool loop)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call],
                            "reasoning_content": "Look it up."},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    core = TextCore(bare_tokenizer, ["ok"])
    settings = ServerSettings(chat_template=QWEN3, reasoning_parser="qwen3")
    with scripted_client(core, settings) as http:
        tokens = http.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
        renamed = [*messages[:1], {**messages[1], "reasoning": "Look it up."}, messages[2]]
        del renamed[1]["reasoning_content"]
        same = http.post("/tokenize", json={"messages": renamed, "tools": [WEATHER]}).json()
        bad = http.post("/v1/chat/completions", json={
            "model": "scripted-model",
            "messages": [{"role": "user", "content": "hi", "reasoning": "no"}]})
    prompt = bare_tokenizer.decode(tokens["tokens"])
    assert "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n<tool_call>" in prompt
    assert same["tokens"] == tokens["tokens"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.[0].reasoning"


def test_without_the_flag_think_tags_stay_content(bare_tokenizer) -> None:
    core = TextCore(bare_tokenizer, ["<think>a</think>b"])
    with scripted_client(core, ServerSettings(chat_template=QWEN3)) as http:
        message = http.post("/v1/chat/completions", json={
            "model": "scripted-model", "messages": QUESTION}).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>a</think>b", "refusal": None}


def test_structured_output_and_named_calls_come_after_the_reasoning(bare_tokenizer) -> None:
    settings = ServerSettings(chat_template=QWEN3, reasoning_parser="qwen3")
    whole, streamed, core = run_chat(bare_tokenizer, ['<think>JSON.</think>\n{"a": 1}'],
                                     settings, response_format={"type": "json_object"})
    assert whole == streamed == {0: choice('{"a": 1}', "JSON.")}
    assert core.params[0].structured.kind == "lark"  # the widened grammar (unit-tested)
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed, _ = run_chat(bare_tokenizer, ['<think>Paris.</think>{"city": "Paris"}'],
                                  settings, tools=[WEATHER], tool_choice=named)
    assert whole == streamed == {0: choice(None, "Paris.", finish="tool_calls", tool_calls=[
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}])}


def test_a_regex_grammar_gets_no_reasoning_split(bare_tokenizer) -> None:
    """A regex binds the output from its first token: no reasoning can come first."""
    core = TextCore(bare_tokenizer, ["<think>ab"])
    settings = ServerSettings(chat_template=QWEN3, reasoning_parser="qwen3")
    with scripted_client(core, settings) as http:
        message = http.post("/v1/chat/completions", json={
            "model": "scripted-model", "messages": QUESTION,
            "structured_outputs": {"regex": "<think>[a-z]+"}}).json()["choices"][0]["message"]
    assert message["content"] == "<think>ab" and "reasoning_content" not in message


# ------------------------------------------------------------------ the Responses API
def test_responses_get_a_reasoning_item(bare_tokenizer) -> None:
    core = TextCore(bare_tokenizer, ["<think>Paris: look it up.</think>\n\nSunny."])
    settings = ServerSettings(chat_template=QWEN3, reasoning_parser="qwen3")
    body = {"model": "scripted-model", "input": "Weather in Paris?"}
    with scripted_client(core, settings) as http:
        whole = http.post("/v1/responses", json=body).json()
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
            events = parse_events(b"".join(response.iter_bytes()))
        again = http.post("/v1/responses", json={
            "model": "scripted-model", "previous_response_id": whole["id"],
            "input": [whole["output"][0], {"role": "user", "content": "Thanks"}]})
    reasoning, message = whole["output"]
    assert {k: reasoning[k] for k in ("type", "summary", "content", "status")} == {
        "type": "reasoning", "summary": [], "status": "completed",
        "content": [{"type": "reasoning_text", "text": "Paris: look it up."}]}
    assert reasoning["id"].startswith("rs_")
    assert message["content"][0]["text"] == "Sunny."
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * sum(
            e["type"] == "response.reasoning_text.delta" for e in events),
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * sum(
            e["type"] == "response.output_text.delta" for e in events),
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.reasoning_text.delta") == "Paris: look it up."
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]
    assert final[0]["content"] == reasoning["content"] and final[1]["content"][0]["text"] == \
        "Sunny."
    assert again.status_code == 200, again.text  # a reasoning item is accepted as input
    assert bare_tokenizer.decode(core.prompts[-1]).count("Paris: look it up.") == 0
