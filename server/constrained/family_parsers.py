"""Tool-call parsers of the families that write calls in a shape of their own (vLLM's parser
names; registered and detected in call_parsers.py):

    mistral         text[TOOL_CALLS][{"name":..,"arguments":{..}}, ...]    v3 tokenizers
                    text[TOOL_CALLS]name{..}[TOOL_CALLS]name{..}         v11+ ([ARGS] may
                                                                         follow the name,
                                                                         [CALL_ID]id before
                                                                         it: Mistral Small
                                                                         3.2's history form)
    pythonic        [f(a=1, b="x"), g()]  the whole output: a Python list of calls with
                    literal keyword arguments (Llama 3.2, Gemma 3 pythonic templates)
    phi4_mini_json  text functools[{"name":..,"arguments":{..}}, ...]     Phi-4-mini
    granite         text<|tool_call|>[{"name":..,"arguments":{..}}, ...]  Granite 3.x (a
                    <tool_call> marker is read the same way: Granite 3.1 writes it too)

Each returns the text before its marker as content and the calls, or, when anything after
the marker is not exactly calls of declared tools with object arguments, the whole text as
content (`no_calls`). Python calls are read with `ast` and `ast.literal_eval`: literals
only, nothing is evaluated.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from plait.server.constrained.parsed import (
    STRICT_JSON,
    ParsedCall,
    ParsedOutput,
    calls_of,
    content_of,
    no_calls,
)

MISTRAL_MARKER = "[TOOL_CALLS]"
# What comes before a call's `{` in the v11+ form: the name, then optionally the call id the
# template shows in history and [ARGS].
_MISTRAL_HEAD = re.compile(r"\s*(?P<name>[^\[\]{}]+?)\s*(?:\[CALL_ID\][A-Za-z0-9]+)?"
                           r"\s*(?:\[ARGS\])?\s*")
PHI4_MARKER = "functools["
GRANITE_MARKERS = ("<|tool_call|>", "<tool_call>")


def _json_value(text: str) -> Any:
    """The one JSON value `text` holds (whitespace around it only); ValueError otherwise
    (also for JSON nested deeper than Python's recursion limit)."""
    body = text.strip()
    try:
        value, end = STRICT_JSON.raw_decode(body)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if body[end:].strip():
        raise ValueError("text after the JSON value")
    return value


def _json_calls(text: str, names: frozenset[str],
                args_keys: tuple[str, ...] = ("arguments",)) -> list[ParsedCall] | None:
    """`text` is a JSON array of calls (or one call object), nothing else: the calls."""
    try:
        return calls_of(_json_value(text), names, args_keys)
    except ValueError:
        return None


# ------------------------------------------------------------------ mistral
def parse_mistral(text: str, names: frozenset[str]) -> ParsedOutput:
    """Text, then [TOOL_CALLS] and a JSON array of calls, or one or more
    [TOOL_CALLS]name{arguments}."""
    start = text.find(MISTRAL_MARKER)
    if start < 0:
        return no_calls(text)
    body = text[start + len(MISTRAL_MARKER):]
    if body.lstrip().startswith("["):
        calls = _json_calls(body, names)
    else:
        calls = _named_calls(body.split(MISTRAL_MARKER), names)
    return ParsedOutput(content_of(text[:start]), calls) if calls else no_calls(text)


def _named_calls(pieces: list[str], names: frozenset[str]) -> list[ParsedCall] | None:
    """Each piece is `name{...}` (or `name[ARGS]{...}`, `name[CALL_ID]id[ARGS]{...}`) with
    name a declared tool."""
    calls = []
    for piece in pieces:
        head, brace, rest = piece.partition("{")
        match = _MISTRAL_HEAD.fullmatch(head)
        if not brace or match is None or match["name"] not in names:
            return None
        name = match["name"]
        try:
            args = _json_value(brace + rest)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


# ------------------------------------------------------------------ pythonic
def parse_pythonic(text: str, names: frozenset[str]) -> ParsedOutput:
    """The whole output (stripped) is `[name(key=literal, ...), ...]`, one call or more."""
    body = text.strip()
    if not body.startswith("["):
        return no_calls(text)
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return no_calls(text)
    if not isinstance(tree, ast.List) or not tree.elts:
        return no_calls(text)
    calls = [_python_call(node, names) for node in tree.elts]
    if any(call is None for call in calls):
        return no_calls(text)
    return ParsedOutput(None, [call for call in calls if call is not None])


def _python_call(node: ast.expr, names: frozenset[str]) -> ParsedCall | None:
    """`name(k=v, ...)` with keyword arguments only, each a JSON-able literal."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in names and not node.args):
        return None
    args: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in args:  # **spread, or a repeated key
            return None
        try:
            args[keyword.arg] = _jsonable(ast.literal_eval(keyword.value))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False))
    except (ValueError, RecursionError):  # inf or nan; nested too deeply
        return None


def _jsonable(value: Any) -> Any:
    """A literal as JSON sees it (tuples become lists); ValueError for sets, bytes,
    complex numbers and non-string keys."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} is not a JSON value")


# ------------------------------------------------------------------ phi-4-mini
def parse_phi4_mini_json(text: str, names: frozenset[str]) -> ParsedOutput:
    """Text, then functools[ and the rest of a JSON array of calls."""
    start = text.find(PHI4_MARKER)
    if start < 0:
        return no_calls(text)
    calls = _json_calls(text[start + len(PHI4_MARKER) - 1:], names, ("arguments", "parameters"))
    return ParsedOutput(content_of(text[:start]), calls) if calls else no_calls(text)


# ------------------------------------------------------------------ granite
def parse_granite(text: str, names: frozenset[str]) -> ParsedOutput:
    """Text, then <|tool_call|> (or <tool_call>) and a JSON array of calls (or one)."""
    found = [(idx, marker) for marker in GRANITE_MARKERS if (idx := text.find(marker)) >= 0]
    if not found:
        return no_calls(text)
    start, marker = min(found)
    calls = _json_calls(text[start + len(marker):], names)
    return ParsedOutput(content_of(text[:start]), calls) if calls else no_calls(text)
