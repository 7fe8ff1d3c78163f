"""Does a JSON value validate against a JSON schema? A small checker for the schemas tools
declare as `parameters`, used to accept a bare JSON tool call (call_parsers.BareCalls).

jsonschema is only a test dependency, so the server carries this subset of draft 2020-12
(the keywords llguidance compiles, which every tool schema passed at check_tool_schemas):

    type enum const                          any value
    properties required additionalProperties patternProperties
    minProperties maxProperties              objects
    items prefixItems minItems maxItems uniqueItems                    arrays
    minLength maxLength pattern              strings (pattern: re.search, like jsonschema)
    minimum maximum exclusiveMinimum exclusiveMaximum multipleOf      numbers
    anyOf oneOf allOf not $ref ("#" / "#/..." pointers into the same schema)

Annotations (title, description, default, format, ...) are ignored, as jsonschema does by
default. A schema using any other keyword makes `is_valid` False: the checker says "valid"
only when it knows, so that a caller treating "valid" as "this is a tool call" never
guesses. tests/server/test_server_tool_bare_json.py compares it with jsonschema.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "format", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id", "$comment", "$defs", "definitions", "contentMediaType",
    "contentEncoding"})


class _Unsupported(Exception):
    """The schema uses a keyword (or a form of one) this checker does not implement."""


def is_valid(value: Any, schema: Any) -> bool:
    """True when `value` (parsed JSON) validates against `schema`; False when it does not,
    or when the schema is outside the subset of the module docstring."""
    try:
        return _valid(value, schema, schema)
    except (_Unsupported, re.error, RecursionError, OverflowError, TypeError, AttributeError,
            ValueError):
        return False  # the last three: a malformed schema (llguidance let it through)


def _valid(value: Any, schema: Any, root: Any) -> bool:
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise _Unsupported(schema)
    for key, arg in schema.items():
        if key in _ANNOTATIONS or key.startswith("x-"):
            continue
        check = _KEYWORDS.get(key)
        if check is None:
            raise _Unsupported(key)
        if not check(value, arg, schema, root):
            return False
    return True


# ------------------------------------------------------------------ JSON types
def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "number": _is_number,
    "integer": lambda v: _is_number(v) and float(v).is_integer(),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _type(value: Any, arg: Any, *_: Any) -> bool:
    names = arg if isinstance(arg, list) else [arg]
    if not all(isinstance(n, str) and n in _TYPES for n in names):
        raise _Unsupported(arg)
    return any(_TYPES[n](value) for n in names)


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: true and 1 differ (Python's == says they are equal), 1 and 1.0 do not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------ keywords
def _properties(value: Any, arg: dict, _s: Any, root: Any) -> bool:
    return not isinstance(value, dict) or all(
        _valid(value[k], sub, root) for k, sub in arg.items() if k in value)


def _pattern_properties(value: Any, arg: dict, _s: Any, root: Any) -> bool:
    return not isinstance(value, dict) or all(
        _valid(v, sub, root) for pattern, sub in arg.items()
        for k, v in value.items() if re.search(pattern, k))


def _additional(value: Any, arg: Any, schema: dict, root: Any) -> bool:
    if not isinstance(value, dict):
        return True
    known, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extra = [k for k in value if k not in known and not any(re.search(p, k) for p in patterns)]
    return all(_valid(value[k], arg, root) for k in extra)


def _items(value: Any, arg: Any, schema: dict, root: Any) -> bool:
    if isinstance(arg, list):  # draft 4's tuple form
        raise _Unsupported("items")
    skip = len(schema.get("prefixItems", []))
    return not isinstance(value, list) or all(_valid(v, arg, root) for v in value[skip:])


def _prefix_items(value: Any, arg: list, _s: Any, root: Any) -> bool:
    return not isinstance(value, list) or all(
        _valid(v, sub, root) for v, sub in zip(value, arg, strict=False))


def _unique(value: Any, arg: bool, *_: Any) -> bool:
    if not arg or not isinstance(value, list):
        return True
    return not any(_equal(a, b) for i, a in enumerate(value) for b in value[i + 1:])


def _bound(applies: Callable[[Any], bool], measure: Callable[[Any], Any],
           holds: Callable[[Any, Any], bool]) -> Callable[..., bool]:
    def check(value: Any, arg: Any, *_: Any) -> bool:
        if not _is_number(arg):  # draft 4's boolean exclusiveMinimum, for one
            raise _Unsupported(arg)
        return not applies(value) or holds(measure(value), arg)
    return check


def _multiple_of(value: Any, arg: Any, *_: Any) -> bool:
    if not _is_number(arg) or arg <= 0:
        raise _Unsupported(arg)
    if not _is_number(value):
        return True
    if isinstance(arg, float):  # as jsonschema: 0.3 is not a multiple of 0.1
        quotient = value / arg
        return int(quotient) == quotient
    return value % arg == 0


def _ref(value: Any, arg: Any, _s: Any, root: Any) -> bool:
    if not isinstance(arg, str) or not arg.startswith("#"):
        raise _Unsupported(arg)
    target = root
    for part in [p for p in arg[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise _Unsupported(arg)
    return _valid(value, target, root)


def _same(value: Any) -> Any:
    return value


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_list(value: Any) -> bool:
    return isinstance(value, list)


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


_KEYWORDS: dict[str, Callable[..., bool]] = {
    "type": _type,
    "enum": lambda v, arg, *_: any(_equal(v, x) for x in arg),
    "const": lambda v, arg, *_: _equal(v, arg),
    "properties": _properties,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional,
    "required": lambda v, arg, *_: not isinstance(v, dict) or all(k in v for k in arg),
    "minProperties": _bound(_is_dict, len, lambda n, b: n >= b),
    "maxProperties": _bound(_is_dict, len, lambda n, b: n <= b),
    "items": _items,
    "prefixItems": _prefix_items,
    "minItems": _bound(_is_list, len, lambda n, b: n >= b),
    "maxItems": _bound(_is_list, len, lambda n, b: n <= b),
    "uniqueItems": _unique,
    "minLength": _bound(_is_str, len, lambda n, b: n >= b),
    "maxLength": _bound(_is_str, len, lambda n, b: n <= b),
    "pattern": lambda v, arg, *_: not isinstance(v, str) or re.search(arg, v) is not None,
    "minimum": _bound(_is_number, _same, lambda x, b: x >= b),
    "maximum": _bound(_is_number, _same, lambda x, b: x <= b),
    "exclusiveMinimum": _bound(_is_number, _same, lambda x, b: x > b),
    "exclusiveMaximum": _bound(_is_number, _same, lambda x, b: x < b),
    "multipleOf": _multiple_of,
    "anyOf": lambda v, arg, _s, root: any(_valid(v, sub, root) for sub in arg),
    "oneOf": lambda v, arg, _s, root: sum(_valid(v, sub, root) for sub in arg) == 1,
    "allOf": lambda v, arg, _s, root: all(_valid(v, sub, root) for sub in arg),
    "not": lambda v, arg, _s, root: not _valid(v, arg, root),
    "$ref": _ref,
}
