"""What a tool-call parser returns, and the checks every parser shares (call_parsers.py,
family_parsers.py): a call names a declared tool and its arguments are a JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity


STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)  # JSON as the spec has it


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


def call_of(obj: Any, names: frozenset[str], args_keys: tuple[str, ...]) -> ParsedCall | None:
    """{"name": n, <args key>: {...}} with n a known tool -> ParsedCall, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    for key in args_keys:
        if isinstance(obj.get(key), dict):
            return ParsedCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))
    return None


def calls_of(value: Any, names: frozenset[str],
             args_keys: tuple[str, ...]) -> list[ParsedCall] | None:
    """A call object or an array of them -> the calls; None if anything is not a call."""
    items = value if isinstance(value, list) and value else [value]
    calls = [call_of(item, names, args_keys) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def content_of(text: str) -> str | None:
    """`text` as a message's content: None when it is empty or only whitespace."""
    return text if text.strip() else None


def no_calls(text: str) -> ParsedOutput:
    """The parse of a text that holds no (well-formed) call: all of it is content."""
    return ParsedOutput(content_of(text), [])
