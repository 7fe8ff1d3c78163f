"""Tool-calling test helpers shared by the tool test modules: a Hermes-style chat template,
and the streamed deltas of a ChoiceStream reassembled as the openai SDK does, to compare
with the whole message (`choice_message`)."""

from __future__ import annotations

from plait.server.constrained.output_plan import OutputPlan
from plait.server.constrained.output_reader import ChoiceStream, choice_message

HERMES_TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")


def reassemble(plan: OutputPlan, pieces: list[str], finish: str) -> tuple[dict, str]:
    """Feed `pieces`, then accumulate the deltas the way the openai SDK does."""
    stream = ChoiceStream(plan)
    deltas = [stream.feed(p, []) for p in pieces]
    rest, reason = stream.finish(finish)
    message: dict = {"content": stream.role_delta()["content"], "tool_calls": []}
    for delta, _ in [d for batch in deltas for d in batch] + rest:
        if "content" in delta:
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            if call["index"] == len(message["tool_calls"]):
                message["tool_calls"].append({"id": call["id"], "name": call["function"]["name"],
                                              "arguments": ""})
            message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return message, reason


def expected(plan: OutputPlan, text: str, finish: str) -> tuple[dict, str]:
    message, reason = choice_message(plan, text, finish)
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])]
    return {"content": message["content"], "tool_calls": calls}, reason


def split(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]
