"""Helpers for the /v1/responses tests: strict parsing of a Responses event stream and the
checks every stream must pass (order, sequence numbers, deltas adding up to the final
response)."""

from __future__ import annotations

import json
from typing import Any

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def parse_events(raw: bytes) -> list[dict[str, Any]]:
    """Every block is `event: <type>` then `data: <json>` (or a `: ping` comment); the
    event line names the data's type."""
    text = raw.decode()
    assert text.endswith("\n\n"), "a stream ends with a blank line"
    events = []
    for block in text[:-2].split("\n\n"):
        if block.startswith(": "):
            continue
        head, _, data = block.partition("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        assert "\n" not in data, block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):], block
        events.append(payload)
    return events


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Check a whole stream (see the module docstring); returns the terminal response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:3]
    terminals = [k for k in kinds if k in TERMINAL]
    assert len(terminals) == 1 and kinds[-1] == terminals[0], kinds
    response = events[-1]["response"]
    assert kinds[-1] == f"response.{response['status']}"
    for e in events[:2]:
        assert e["response"]["id"] == response["id"]
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == []
    items: dict[int, dict[str, Any]] = {}  # output_index -> what the events built
    for e in events[2:-1]:
        _apply(items, e)
    assert sorted(items) == list(range(len(items)))  # 0, 1, 2 ... in the order added
    if response["status"] != "failed":
        assert all(item["done"] for item in items.values()), items
    assert len(response["output"]) == len(items)
    for idx, built in items.items():
        final = response["output"][idx]
        assert built["item"]["id"] == final["id"] and built["type"] == final["type"]
        if final["type"] == "message":
            assert built["text"] == final["content"][0]["text"]
        else:
            assert built["arguments"] == final["arguments"]
        if built["done"]:
            assert built["done_item"] == final
    statuses = {item["status"] for item in response["output"]}
    if response["status"] == "completed":
        assert statuses <= {"completed"}
    if response["status"] == "incomplete":
        assert "incomplete" in statuses
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    return response


def _apply(items: dict[int, dict[str, Any]], e: dict[str, Any]) -> None:
    kind, idx = e["type"], e.get("output_index")
    if kind == "error":
        return
    if kind == "response.output_item.added":
        assert idx == len(items), (idx, len(items))  # added in output_index order
        assert e["item"]["status"] == "in_progress"
        items[idx] = {"item": e["item"], "type": e["item"]["type"], "text": "", "arguments": "",
                      "parts": 0, "done": False, "text_done": False}
        return
    built = items[idx]
    assert not built["done"], f"{kind} after output_item.done"
    if kind != "response.output_item.done":
        assert e["item_id"] == built["item"]["id"]
    if kind == "response.content_part.added":
        assert built["type"] == "message" and built["parts"] == 0 and e["content_index"] == 0
        built["parts"] = 1
    elif kind == "response.output_text.delta":
        assert built["parts"] == 1 and not built["text_done"]
        built["text"] += e["delta"]
    elif kind == "response.output_text.done":
        assert e["text"] == built["text"]
        built["text_done"] = True
    elif kind == "response.content_part.done":
        assert built["text_done"] and e["part"]["text"] == built["text"]
    elif kind == "response.function_call_arguments.delta":
        assert built["type"] == "function_call"
        built["arguments"] += e["delta"]
    elif kind == "response.function_call_arguments.done":
        assert e["arguments"] == built["arguments"]
        built["arguments_done"] = True
    elif kind == "response.output_item.done":
        if built["type"] == "message":
            assert built["text_done"]
        else:
            assert built.get("arguments_done")
        assert e["item"]["status"] in ("completed", "incomplete")
        built.update(done=True, done_item=e["item"])
    else:
        raise AssertionError(f"unexpected event {kind}")
