"""Tool-call parsers: a model's generated text -> (content, tool calls), one per model family.

A parser is used for `tool_choice: "auto"` when the model's chat template renders `tools`
itself (the model was trained on a tool-call format); `detect_parser` picks it from the
template's source. Models without a tool format get the "json" parser and a grammar
instead (output_plan.py).

    name          output format                                          detected by, in order
    mistral       text[TOOL_CALLS] + a JSON array, or name{..} per call     "[TOOL_CALLS]"
    granite       text<|tool_call|>[{"name":..,"arguments":{..}}, ...]      "<|tool_call|>" (before
                                                                            hermes: Granite 3.x
                                                                            templates may show
                                                                            <tool_call> too)
    phi4_mini_json  text functools[{"name":..,"arguments":{..}}, ...]       "functools["
    pythonic      [f(a=1), g()] (Llama 3.2, Gemma 3 pythonic templates)     "[func_name1(" or
                                                                            "python list" (before
                                                                            llama3_json: "ipython")
    hermes        text <tool_call>{"name":..,"arguments":{..}}</tool_call>  "<tool_call>" in the
                  (Hermes 2/3, Qwen 2/2.5/3; several calls = several tags)  template
    llama3_json   {"name":..,"parameters":{..}}, optionally after           "<|python_tag|>" or
                  <|python_tag|>, several separated by ";" (Llama 3.1+)     "ipython" in it
    json          {"name":..,"arguments":{..}} or an array of them          (the fallback)

The first four are in family_parsers.py. `--tool-call-parser NAME` (ServerSettings
.tool_call_parser) overrides the detection: that family's parser, with the tools given to
the template, whatever the template shows.

Whatever the parser, with tool_choice "auto" an answer that is nothing but call JSON without
the family's markers (what small models often write) is a call too: `BareCalls`, tried
after the parser found none.

To add a family: write a `ToolParser` (a `parse` function, plus the text that starts a call
in `markers`, used when streaming to hold text back), register it in `PARSERS`, add its
detection rule to `_DETECTION` and its name to settings.TOOL_CALL_PARSERS; test it as
tests/server/test_server_tool_families.py does (docs/tools.md, "Adding a parser").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from plait.server.constrained.family_parsers import (
    GRANITE_MARKERS,
    MISTRAL_MARKER,
    PHI4_MARKER,
    parse_granite,
    parse_mistral,
    parse_phi4_mini_json,
    parse_pythonic,
)
from plait.server.constrained.parsed import (
    ParsedCall,
    ParsedOutput,
    call_of,
    calls_of,
    content_of,
)
from plait.server.constrained.schema_check import is_valid

__all__ = ["PARSERS", "BareCalls", "ParsedCall", "ParsedOutput", "ToolParser", "detect_parser"]


@dataclass(frozen=True, slots=True)
class ToolParser:
    """`parse(text, tool_names)` never raises; malformed calls leave the text as content.
    `markers`: strings that begin a call; `at_start`: calls only at the start of the
    output (then any text before a marker means: no calls). `keep_special`: a marker is a
    special token of the family's tokenizer ([TOOL_CALLS], <|tool_call|>), so the output
    is decoded with special tokens kept (unless the request sets skip_special_tokens)."""

    name: str
    parse: Callable[[str, frozenset[str]], ParsedOutput]
    markers: tuple[str, ...]
    at_start: bool
    keep_special: bool = False


# ------------------------------------------------------------------ json (the fallback)
def parse_json(text: str, names: frozenset[str]) -> ParsedOutput:
    """The whole output is a call object or an array of calls; anything else is text."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            calls = calls_of(json.loads(stripped), names, ("arguments",))
        except (ValueError, RecursionError):  # deep nesting: not a call
            calls = None
        if calls:
            return ParsedOutput(None, calls)
    return ParsedOutput(content_of(text), [])


# ------------------------------------------------------------------ hermes / qwen
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, names: frozenset[str]) -> ParsedOutput:
    """Text, then one or more <tool_call>JSON</tool_call> (the last may lack its closing
    tag when generation stopped at it)."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedOutput(content_of(text), [])
    calls = []
    for match in _HERMES.finditer(text, start):
        try:
            call = call_of(json.loads(match.group(1)), names, ("arguments", "parameters"))
        except (ValueError, RecursionError):
            call = None
        if call is None:
            return ParsedOutput(content_of(text), [])
        calls.append(call)
    return ParsedOutput(content_of(text[:start]), calls)


# ------------------------------------------------------------------ llama 3 json
def parse_llama3_json(text: str, names: frozenset[str]) -> ParsedOutput:
    """[<|python_tag|>]{"name":..,"parameters":{..}}[; {...}]: the whole output."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedOutput(content_of(text), [])
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return ParsedOutput(content_of(text), [])
        call = call_of(obj, names, ("parameters", "arguments"))
        if call is None:
            return ParsedOutput(content_of(text), [])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedOutput(None, calls)


# ------------------------------------------------------------------ bare JSON (any family)
_FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\n?", re.IGNORECASE)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


@dataclass(frozen=True, slots=True)
class BareCalls:
    """tool_choice "auto": a whole answer that is call JSON written without the model's
    markers. The answer, stripped, optionally inside one ```json (or ```) fence, must be

        {"name": <declared tool>, "arguments": <object, or a JSON string of one>}

    ("parameters" for "arguments": Llama 3.1's documented format; no other key) or a
    non-empty array of such objects (one only when parallel_tool_calls is false), and each
    call's arguments must validate against its tool's `parameters` schema (schema_check.py).
    Anything else stays content, unchanged. `schemas`: tool name -> parameters schema."""

    schemas: Mapping[str, Any]
    parallel: bool

    def parse(self, text: str) -> list[ParsedCall] | None:
        """The calls when the whole of `text` is bare call JSON, else None."""
        body, fenced = _unfence(text.strip())
        if fenced and not body.endswith("```"):
            return None
        body = body.removesuffix("```").strip() if fenced else body
        if not body.startswith(("{", "[")):
            return None
        try:
            return self._calls(_DECODER.decode(body))
        except (ValueError, RecursionError):
            return None

    def possible(self, text: str) -> bool:
        """Could `text`, the answer so far, still grow into bare call JSON? False as soon as
        it cannot: its first characters are not `{`, `[` or a fence, or its JSON value is
        complete and is not calls, or is followed by more than a closing fence. (Broken JSON
        is only found out at the end.)"""
        head = text.lstrip()
        if head.startswith("`") and "```json".startswith(head.lower()):
            return True  # the opening fence, so far
        body, fenced = _unfence(head)
        if not body:
            return True
        if not body.startswith(("{", "[")):
            return False
        inner = body[1:].lstrip()
        if inner and inner[0] not in ('"' if body[0] == "{" else "{"):
            return False  # "{x", "[1": not a call's start
        try:
            value, end = _DECODER.raw_decode(body)
        except RecursionError:
            return False  # nested deeper than any call is read
        except ValueError:
            return True  # not complete yet
        rest = body[end:].strip()
        return self._calls(value) is not None and (
            "```".startswith(rest) if fenced else not rest)

    def _calls(self, value: Any) -> list[ParsedCall] | None:
        items = value if isinstance(value, list) else [value]
        if not items or (len(items) > 1 and not self.parallel):
            return None
        calls = [self._call(item) for item in items]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]

    def _call(self, obj: Any) -> ParsedCall | None:
        name = obj.get("name") if isinstance(obj, dict) and len(obj) == 2 else None
        if not isinstance(name, str) or name not in self.schemas:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if isinstance(args, str):
            try:
                args = _DECODER.decode(args)
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict) or not is_valid(args, self.schemas[name]):
            return None
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _unfence(text: str) -> tuple[str, bool]:
    """(what follows an opening ```json / ``` fence, True), or (text, False) without one."""
    match = _FENCE_OPEN.match(text) if text.startswith("```") else None
    return (text[match.end():].lstrip(), True) if match else (text, False)


PARSERS: dict[str, ToolParser] = {
    "json": ToolParser("json", parse_json, ("{", "["), at_start=True),
    "hermes": ToolParser("hermes", parse_hermes, ("<tool_call>",), at_start=False),
    "llama3_json": ToolParser("llama3_json", parse_llama3_json, ("{", "<|python_tag|>"),
                              at_start=True),
    "mistral": ToolParser("mistral", parse_mistral, (MISTRAL_MARKER,), at_start=False,
                          keep_special=True),
    "pythonic": ToolParser("pythonic", parse_pythonic, ("[",), at_start=True),
    "phi4_mini_json": ToolParser("phi4_mini_json", parse_phi4_mini_json, (PHI4_MARKER,),
                                 at_start=False),
    "granite": ToolParser("granite", parse_granite, GRANITE_MARKERS, at_start=False,
                          keep_special=True),
}
# (text in the template, parser), first match wins: see the module docstring.
_DETECTION = (
    (MISTRAL_MARKER, "mistral"),
    ("<|tool_call|>", "granite"),
    (PHI4_MARKER, "phi4_mini_json"),
    ("[func_name1(", "pythonic"),
    ("python list", "pythonic"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)


def detect_parser(template: str | None, override: str | None = None) -> ToolParser | None:
    """The parser named `override` (--tool-call-parser), else the parser of the model family
    whose chat template is `template`, or None when the template does not render tools
    (then output_plan.py renders them and uses a grammar)."""
    if override is not None:
        return PARSERS[override]
    if not template or "tools" not in template:
        return None
    return next((PARSERS[name] for text, name in _DETECTION if text in template), None)
