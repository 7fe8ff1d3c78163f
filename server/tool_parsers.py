"""Tool-call parsers: a model's generated text -> (content, tool calls), one per model family.

A parser is used for `tool_choice: "auto"` when the model's chat template renders `tools`
itself (the model was trained on a tool-call format); `detect_parser` picks it from the
template's source. Models without a tool format get the "json" parser and a grammar
instead (tools.py).

    name          output format                                          detected by
    hermes        text <tool_call>{"name":..,"arguments":{..}}</tool_call>  "<tool_call>" in the
                  (Hermes 2/3, Qwen 2/2.5/3; several calls = several tags)  template
    llama3_json   {"name":..,"parameters":{..}}, optionally after           "<|python_tag|>" or
                  <|python_tag|>, several separated by ";" (Llama 3.1+)     "ipython" in it
    json          {"name":..,"arguments":{..}} or an array of them          (the fallback)

To add a family: write a `ToolParser` (a `parse` function, plus the text that starts a call
in `markers`, used when streaming to hold text back), register it in `PARSERS`, and add its
detection rule to `detect_parser`. A test in tests/test_server_tools.py per parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """`content` is the text outside the calls (None when there is none, or only
    whitespace); `calls` is empty when the text holds no well-formed call."""

    content: str | None
    calls: list[ParsedCall]


@dataclass(frozen=True, slots=True)
class ToolParser:
    """`parse(text, tool_names)` never raises; malformed calls leave the text as content.
    `markers`: strings that begin a call; `at_start`: calls only at the start of the
    output (then any text before a marker means: no calls)."""

    name: str
    parse: Callable[[str, frozenset[str]], ParsedOutput]
    markers: tuple[str, ...]
    at_start: bool


def _call_of(obj: Any, names: frozenset[str], args_keys: tuple[str, ...]) -> ParsedCall | None:
    """{"name": n, <args key>: {...}} with n a known tool -> ParsedCall, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    for key in args_keys:
        if isinstance(obj.get(key), dict):
            return ParsedCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))
    return None


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _calls_of(value: Any, names: frozenset[str],
              args_keys: tuple[str, ...]) -> list[ParsedCall] | None:
    """A call object or an array of them -> the calls; None if anything is not a call."""
    items = value if isinstance(value, list) and value else [value]
    calls = [_call_of(item, names, args_keys) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


# ------------------------------------------------------------------ json (the fallback)
def parse_json(text: str, names: frozenset[str]) -> ParsedOutput:
    """The whole output is a call object or an array of calls; anything else is text."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            calls = _calls_of(json.loads(stripped), names, ("arguments",))
        except ValueError:
            calls = None
        if calls:
            return ParsedOutput(None, calls)
    return ParsedOutput(_content(text), [])


# ------------------------------------------------------------------ hermes / qwen
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, names: frozenset[str]) -> ParsedOutput:
    """Text, then one or more <tool_call>JSON</tool_call> (the last may lack its closing
    tag when generation stopped at it)."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedOutput(_content(text), [])
    calls = []
    for match in _HERMES.finditer(text, start):
        try:
            call = _call_of(json.loads(match.group(1)), names, ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return ParsedOutput(_content(text), [])
        calls.append(call)
    return ParsedOutput(_content(text[:start]), calls)


# ------------------------------------------------------------------ llama 3 json
def parse_llama3_json(text: str, names: frozenset[str]) -> ParsedOutput:
    """[<|python_tag|>]{"name":..,"parameters":{..}}[; {...}]: the whole output."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedOutput(_content(text), [])
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return ParsedOutput(_content(text), [])
        call = _call_of(obj, names, ("parameters", "arguments"))
        if call is None:
            return ParsedOutput(_content(text), [])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedOutput(None, calls)


PARSERS: dict[str, ToolParser] = {
    "json": ToolParser("json", parse_json, ("{", "["), at_start=True),
    "hermes": ToolParser("hermes", parse_hermes, ("<tool_call>",), at_start=False),
    "llama3_json": ToolParser("llama3_json", parse_llama3_json, ("{", "<|python_tag|>"),
                              at_start=True),
}


def detect_parser(template: str | None) -> ToolParser | None:
    """The parser of the model family whose chat template is `template`, or None when the
    template does not render tools (then tools.py renders them and uses a grammar)."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if "<|python_tag|>" in template or "ipython" in template:
        return PARSERS["llama3_json"]
    return None
