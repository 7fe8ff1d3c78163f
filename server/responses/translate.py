"""A Responses request -> the chat request it means (then run by chat's own `chat_input`).

    instructions                          {"role": "system", "content": ...} first
    input "text"                          {"role": "user", "content": "text"}
    {"type": "message", role, content}    {"role", "content"} (input_text / output_text parts
                                          joined; "developer" is chat's "developer")
    {"type": "function_call", call_id,    an assistant message's tool_calls entry (calls
     name, arguments}                     right after an assistant message join it)
    {"type": "function_call_output",      {"role": "tool", "tool_call_id", "content"}
     call_id, output}
    tools [{"type": "function", name,     [{"type": "function", "function": {name, ...}}]
      parameters, strict, description}]
    tool_choice {"type": "function",      {"type": "function", "function": {"name": ...}}
      "name": ...}
    text.format                           response_format (json_schema's fields nested)
    max_output_tokens                     max_completion_tokens
    include logprobs, top_logprobs        logprobs: true, top_logprobs

Input items are checked here (400s name `input.[i]...`); everything else is checked by
chat's code, whose 400s are renamed to the Responses parameter (`renamed`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from pydantic import ValidationError

from plait.server.errors import APIError, bad_request, echo, validation_error
from plait.server.protocol import ChatCompletionRequest
from plait.server.responses.protocol import LOGPROBS_INCLUDE, PASSTHROUGH, ResponsesRequest

T = TypeVar("T")
Item = dict[str, Any]
_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}
# Chat's parameter names in its 400s -> the Responses names (applied in order).
_RENAMES = (
    (re.compile(r"tools\.\[(\d+)\]\.function\b"), r"tools.[\1]"),
    (re.compile(r"tool_choice\.function\b"), "tool_choice"),
    (re.compile(r"response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"\bmessages(?=\.\[|'|$)"), "input"),
)


def new_item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ input items
def input_items(value: str | list[dict[str, Any]] | None) -> list[Item]:
    """The request's `input` as checked items in their canonical shape, each with an id
    (what /input_items lists and what a continued conversation replays)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}])]
    return [_checked_item(item, i) for i, item in enumerate(value)]


def _message(role: str, content: list[Item], item_id: str | None = None) -> Item:
    return {"id": item_id or new_item_id("msg"), "type": "message", "role": role,
            "status": "completed", "content": content}


def _checked_item(item: dict[str, Any], i: int) -> Item:
    kind = item.get("type", "message")
    if not isinstance(kind, str) or kind not in _ITEM_KEYS:
        raise bad_request(f"Plait does not support input items of type {echo(kind)}: only "
                          "message, function_call, function_call_output and reasoning items.",
                          f"input.[{i}].type", "unsupported_parameter")
    unknown = sorted(set(item) - _ITEM_KEYS[kind])
    if unknown:
        raise bad_request(f"Unrecognized field {echo(unknown[0])} in 'input.[{i}]'.",
                          f"input.[{i}].{unknown[0]}", "unknown_parameter")
    item_id = _optional_str(item, "id", i) or new_item_id(_ITEM_PREFIX[kind])
    if kind == "reasoning":
        return reasoning_item(_reasoning_text(item.get("content"), i), item_id)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"Invalid value for 'input.[{i}].role': {echo(role)}. Expected "
                              "one of system, developer, user, assistant.",
                              f"input.[{i}].role", "invalid_value")
        return _message(role, _content_parts(item.get("content"), role, f"input.[{i}].content"),
                        item_id)
    call_id = _required_str(item, "call_id", i)
    if kind == "function_call":
        arguments = _required_str(item, "arguments", i)
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_request(f"Invalid 'input.[{i}].arguments': expected a JSON object as "
                              "text.", f"input.[{i}].arguments", "invalid_value")
        return {"id": item_id, "type": kind, "call_id": call_id,
                "name": _required_str(item, "name", i), "arguments": arguments,
                "status": "completed"}
    output = item.get("output")
    text = output if isinstance(output, str) else _joined(
        _content_parts(output, "tool", f"input.[{i}].output"))
    return {"id": item_id, "type": kind, "call_id": call_id, "output": text,
            "status": "completed"}


def _content_parts(content: Any, role: str, param: str) -> list[Item]:
    """A message's content as output_text (assistant) or input_text parts."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [_part(kind, content)]
    if not isinstance(content, list):
        raise bad_request(f"Invalid type for '{param}': expected a string or an array of "
                          "text parts.", param, "invalid_type")
    parts = []
    for j, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if part_type not in _TEXT_PARTS:
            raise bad_request(f"Invalid content part type {echo(part_type)} in '{param}': "
                              "Plait serves text-only models; only input_text and output_text "
                              "parts are supported.", f"{param}.[{j}].type", "invalid_value")
        if not isinstance(text, str):
            raise bad_request(f"Invalid '{param}.[{j}].text': expected a string.",
                              f"{param}.[{j}].text", "invalid_type")
        parts.append(_part(kind, text))
    return parts


def _part(kind: str, text: str) -> Item:
    if kind == "output_text":
        return {"type": kind, "text": text, "annotations": []}
    return {"type": kind, "text": text}


def _joined(parts: list[Item]) -> str:
    return "\n".join(part["text"] for part in parts)


def _required_str(item: dict[str, Any], key: str, i: int) -> str:
    value = _optional_str(item, key, i)
    if value is None:
        raise bad_request(f"Missing required parameter: 'input.[{i}].{key}'.",
                          f"input.[{i}].{key}", "missing_required_parameter")
    return value


def _optional_str(item: dict[str, Any], key: str, i: int) -> str | None:
    value = item.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"Invalid type for 'input.[{i}].{key}': expected a string, but got "
                          f"{echo(value)} instead.", f"input.[{i}].{key}", "invalid_type")
    return value


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> Item:
    """A reasoning item (--reasoning-parser's output) holding `text` as one part."""
    return {"id": item_id or new_item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _reasoning_text(content: Any, i: int) -> str:
    """The text of a reasoning item's content: null, or reasoning_text parts."""
    param = f"input.[{i}].content"
    parts = [] if content is None else content
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == "reasoning_text"
            and isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"Invalid '{param}': expected an array of reasoning_text parts.",
                          param, "invalid_value")
    return "".join(p["text"] for p in parts)


# ------------------------------------------------------------------ chat messages
def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Checked conversation items -> chat messages (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    joinable = False  # the last message is an assistant turn calls may join
    for item in items:
        if item["type"] == "reasoning":  # not replayed: templates drop earlier reasoning
            continue
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": _joined(item["content"])})
            joinable = item["role"] == "assistant"
            continue
        if item["type"] == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
            joinable = False
            continue
        if not joinable:
            messages.append({"role": "assistant", "content": None})
            joinable = True
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        messages[-1].setdefault("tool_calls", []).append(call)
    return messages


# ------------------------------------------------------------------ the request
def chat_request(body: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
    """The chat request that `body` means over the conversation `items` (earlier turns
    first). 400s name the Responses parameter."""
    if not items:
        raise bad_request("Missing required parameter: 'input'.", "input",
                          "missing_required_parameter")
    data: dict[str, Any] = {"model": body.model,
                            "messages": chat_messages(body.instructions, items)}
    data.update((name, getattr(body, name)) for name in PASSTHROUGH
                if getattr(body, name) is not None)
    data["max_completion_tokens"] = body.max_output_tokens
    data["stream"] = body.stream
    if LOGPROBS_INCLUDE in (body.include or []):
        data.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    if body.tools is not None:
        data["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    data["tool_choice"] = _chat_tool_choice(body.tool_choice)
    data["response_format"] = _response_format(body.text)
    _check_n(body)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise rename(validation_error(exc.errors())) from None


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise bad_request(f"Plait does not support {echo(kind)} tools: only function tools "
                          "(built-in tools such as web search, file search or code "
                          "interpreter are not available).", f"tools.[{i}].type",
                          "unsupported_parameter")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise bad_request(f"Plait does not support tool_choice of type "
                          f"{echo(choice.get('type'))}: only \"none\", \"auto\", \"required\" "
                          'or {"type": "function", "name": ...}.', "tool_choice",
                          "unsupported_parameter")
    return {"type": "function", "function": {k: v for k, v in choice.items() if k != "type"}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise bad_request(f"Unrecognized field {echo(unknown[0])} in 'text'.",
                          f"text.{unknown[0]}", "unknown_parameter")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("Plait does not support the 'text.verbosity' parameter.",
                          "text.verbosity", "unsupported_parameter")
    fmt = text.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    fields = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": fields}


def _check_n(body: ResponsesRequest) -> None:
    """n > 1 gives n message items; tool calls are not combined with it."""
    if body.num_choices > 1 and body.tools and body.tool_choice != "none":
        raise bad_request("Invalid 'n': n > 1 is only supported without tools (or with "
                          'tool_choice "none").', "n", "invalid_value")


# ------------------------------------------------------------------ error names
def rename(error: APIError) -> APIError:
    """A chat 400 with the Responses parameter names (in `param` and the message)."""
    for pattern, name in _RENAMES:
        if error.param is not None:
            error.param = pattern.sub(name, error.param)
        error.message = pattern.sub(name, error.message)
    return error


async def renamed(work: Awaitable[T]) -> T:
    """Await chat's checks, renaming the parameters in their 400s."""
    try:
        return await work
    except APIError as exc:
        if exc.status == 400:
            raise rename(exc) from None
        raise
