"""ChoiceStream with a reasoning parser: for any chunking, the streamed deltas add up to the
whole message (reasoning, content, calls, finish_reason), for text, the Hermes parser and
a named function, with logprobs never lost."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.engine import TokenLogprob
from plait.server.constrained.output_plan import plan_output
from plait.server.constrained.output_reader import ChoiceStream, choice_message
from plait.server.protocol import ChatCompletionRequest
from plait.server.reasoning import REASONING_FORMATS

HERMES = "{% if tools %}<tool_call>{% endif %}{{ messages }}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def plan(fmt: str, **fields):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    return replace(plan_output(body, HERMES), reasoning=REASONING_FORMATS[fmt])


def streamed(p, text: str, size: int, finish: str) -> tuple[dict, str | None, int]:
    stream = ChoiceStream(p)
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i:i + size], [TokenLogprob(i, -1.0, [])])
    rest, reason = stream.finish(finish)
    deltas += rest
    got: dict = {"content": None, "reasoning_content": None, "tool_calls": []}
    for delta, _ in deltas:
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                got[key] = (got[key] or "") + delta[key]
        for call in delta.get("tool_calls", []):
            if "id" in call:
                got["tool_calls"].append({"name": call["function"]["name"], "arguments": ""})
            got["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return got, reason, sum(len(lps) for _, lps in deltas)


def whole(p, text: str, finish: str) -> tuple[dict, str | None]:
    message, reason = choice_message(p, text, finish)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])]
    return {"content": message["content"] or None,
            "reasoning_content": message["reasoning_content"] or None,
            "tool_calls": calls}, reason


CASES = [
    ("qwen3", {}, "<think>\nhmm\n</think>\n\nSunny."),
    ("qwen3", {}, "No thinking at all."),
    ("qwen3", {"tools": [WEATHER]}, f"<think>need it</think>\n\n{CALL}"),
    ("qwen3", {"tools": [WEATHER]}, f"<think>{CALL}?</think>No call."),
    ("deepseek_r1", {}, "plan</think>Answer"),
    ("deepseek_r1", {"tools": [WEATHER]}, f"plan</think>Let me check.\n{CALL}"),
    ("deepseek_r1", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, 'x</think>{"city": "Oslo"}'),
]


@pytest.mark.parametrize(("fmt", "fields", "text"), CASES)
@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_stream_adds_up_to_the_whole(fmt, fields, text, size) -> None:
    p = plan(fmt, **fields)
    got, reason, num_logprobs = streamed(p, text, size, "stop")
    assert (got, reason) == whole(p, text, "stop")
    assert num_logprobs == len(range(0, len(text), size))  # every piece's logprob sent once
