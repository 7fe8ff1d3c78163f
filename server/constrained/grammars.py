"""`response_format` and tool grammars -> `StructuredSpec` for the engine, checked up front.

Every schema the server hands the engine is made compact and closed:

* unless the schema says otherwise (its own top-level "x-guidance" key), llguidance is told
  `whitespace_flexible: false` and no whitespace pattern, so the output is `{"a":1}`: fewer
  tokens, and nothing for a small model to loop on (llguidance's default allows any run of
  whitespace; the engine's default, a bounded run, still allows pretty-printing);
* an object schema with `properties` and no `additionalProperties` (nor
  `patternProperties` / `unevaluatedProperties`) gets `additionalProperties: false` (what
  OpenAI's strict mode requires, and xgrammar's default): left open, a small model keeps
  inventing keys. Only where that just shrinks the output space (`close_objects`), so
  every output still validates against the schema the client sent; a schema that closing
  would make unsatisfiable is used as sent.

Tool grammars (output_plan.py decides which one a request gets):

    call(t)      {"name": <t's name>, "arguments": <t's parameters schema>}
    calls        anyOf call(t) over the tools; with parallel calls: an array of 1+ of them
    named(t)     t's parameters schema itself (the server wraps it into a call)
    auto         Lark: start: TEXT | %json{calls}; TEXT never starts with "{" / "[" / space,
                 so the first character commits the model to text or to a call

Each tool's schema is moved under the combined schema's `$defs` (`#/$defs/tool<i>`) and its
local references ("#/...") are rewritten to point below it, so `$ref`/`$defs` inside
tool parameters keep working.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any, TypeVar

from plait.engine import StructuredSpec, structured_error
from plait.server.constrained.request_fields import ResponseFormat, Tool, parse_response_format
from plait.server.errors import bad_request
from plait.server.offload import INLINE_MAX_SIZE, offload

T = TypeVar("T")

# The engine's default whitespace (a bounded pattern) is replaced by none at all.
COMPACT = {"whitespace_flexible": False, "whitespace_pattern": None}
# Plain text: first character not "{", "[" or whitespace (those would start, or hide, JSON).
_TEXT_TERMINAL = r"/[^{\[\s][\s\S]*/"


def checked_spec(schema: dict[str, Any], param: str) -> StructuredSpec:
    """The compact JSON-schema spec of `schema`: closed where that is safe
    (`close_objects`) when the closed schema compiles, else as sent; a 400 naming `param`
    when that cannot compile either. One compile check in the common case."""
    closed = close_objects(schema)
    if closed != schema:
        spec = _compact_spec(closed)
        if structured_error(spec) is None:
            return spec
    return check_spec(_compact_spec(schema), param)


def _compact_spec(schema: dict[str, Any]) -> StructuredSpec:
    """llguidance's compact-whitespace option added unless the schema sets its own."""
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": COMPACT}
    return StructuredSpec("json_schema", json.dumps(schema))


_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "x-guidance"})
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Subschemas applied to the same instance as the node holding them: closing one of them (or
# the node) would forbid the other's keys.
_SAME_INSTANCE = ("allOf", "anyOf", "oneOf", "then", "else", "dependentSchemas", "$ref")
# Subschemas whose narrowing could widen what the node accepts (a negation, a condition):
# nothing under them is ever closed.
_INVERTED = ("not", "if")


def close_objects(node: Any, closable: bool = True) -> Any:
    """A copy of `node` where object schemas that list `properties` and say nothing about
    other keys forbid them. Only narrowing that keeps every output valid for `node` is
    done: never under `not` / `if`, never on a node combined with others on the same
    instance (`allOf`/`anyOf`/`oneOf`/`$ref`/`then`/`else`/`dependentSchemas`, the node
    and those branches both), never when `required` names a key `properties` lacks."""
    if isinstance(node, list):
        return [close_objects(item, closable) for item in node]
    if not isinstance(node, dict):
        return node
    combined = any(key in node for key in _SAME_INSTANCE)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYS or key in _INVERTED:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key == "dependentSchemas" and isinstance(value, dict):
            out[key] = {name: close_objects(sub, False) for name, sub in value.items()}
        else:
            out[key] = close_objects(value, key not in _SAME_INSTANCE)
    properties = node.get("properties")
    required = node.get("required")
    if (closable and not combined and isinstance(properties, dict)
            and not any(key in node for key in _OPEN_KEYS)
            and (not isinstance(required, list) or set(required) <= set(properties))):
        out["additionalProperties"] = False
    return out


async def build_off_loop(fn: Callable[..., T], *args: Any, param: str) -> T:
    """`fn(*args)` (building and checking schemas) on a worker thread: checking a large
    schema holds the CPU for up to a second. A schema nested deeper than the recursion
    limit is a 400 naming `param`."""
    return await offload(_depth_checked, fn, param, *args, size=INLINE_MAX_SIZE + 1)


def _depth_checked(fn: Callable[..., T], param: str, *args: Any) -> T:
    try:
        return fn(*args)
    except RecursionError:
        raise bad_request(f"Invalid '{param}': the schema is nested too deeply.", param,
                          "invalid_value") from None


def check_spec(spec: StructuredSpec, param: str) -> StructuredSpec:
    """`spec`, or a 400 naming `param` with llguidance's reason when it cannot compile."""
    error = structured_error(spec)
    if error:
        raise bad_request(f"Invalid '{param}': the schema is not supported: "
                          f"{_first_line(error)}", param, "invalid_value")
    return spec


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "invalid schema"
    return line[:500]


def response_format_spec(rf: ResponseFormat | None) -> StructuredSpec | None:
    """The constraint for `response_format` (None for text), checked: 400
    `response_format` for a schema llguidance rejects."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object" or rf.json_schema is None or rf.json_schema.schema_ is None:
        return checked_spec({"type": "object"}, "response_format")
    return checked_spec(rf.json_schema.schema_, "response_format.json_schema.schema")


def check_tool_schemas(tools: list[Tool]) -> None:
    """400 `tools.[i].function.parameters` for a parameters schema that cannot compile."""
    for i, tool in enumerate(tools):
        params = tool.function.parameters_schema
        check_spec(StructuredSpec("json_schema", json.dumps(params)),
                   f"tools.[{i}].function.parameters")


# ------------------------------------------------------------------ tool-call schemas
def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of `node` whose local `$ref`s ("#", "#/...") point below `base`."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            else:
                out[key] = _rebase_refs(value, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    return node


def calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """The schema of one call (parallel=False) or of an array of 1+ calls, where a call is
    {"name": <a tool's name>, "arguments": <that tool's parameters>}."""
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        key = f"tool{i}"
        defs[key] = _rebase_refs(copy.deepcopy(tool.function.parameters_schema),
                                 f"#/$defs/{key}")
        branches.append({
            "type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "arguments": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "arguments"], "additionalProperties": False})
    one = branches[0] if len(branches) == 1 else {"anyOf": branches}
    body = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return {**body, "$defs": defs}


def required_spec(tools: list[Tool], parallel: bool) -> StructuredSpec:
    return checked_spec(calls_schema(tools, parallel), "tools")


def named_spec(tools: list[Tool], name: str) -> StructuredSpec:
    index, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == name)
    return checked_spec(tool.function.parameters_schema, f"tools.[{index}].function.parameters")


def auto_spec(tools: list[Tool], parallel: bool,
              answer: StructuredSpec | None = None) -> StructuredSpec:
    """Text (or the `answer` JSON schema, when response_format asks for one) or calls."""
    calls = required_spec(tools, parallel).value
    if answer is not None:
        lark = f"start: answer | calls\nanswer: %json {answer.value}\ncalls: %json {calls}\n"
    else:
        lark = f"start: TEXT | calls\nTEXT: {_TEXT_TERMINAL}\ncalls: %json {calls}\n"
    return check_spec(StructuredSpec("lark", lark), "tools")


def answer_spec(response_format: dict[str, Any] | None,
                structured_outputs: dict[str, Any] | None) -> StructuredSpec | None:
    """The answer's constraint, from `response_format` or from vLLM's `structured_outputs`
    (at most one of the two: both is a 400 naming `structured_outputs`); chat and
    completions alike."""
    if structured_outputs is None:
        return response_format_spec(parse_response_format(response_format))
    if response_format is not None:
        raise bad_request("Invalid 'structured_outputs': it cannot be combined with "
                          "'response_format'.", "structured_outputs", "invalid_value")
    return structured_outputs_spec(structured_outputs)


# vLLM's `structured_outputs` request field: exactly one constraint key, plus options that
# only tune vLLM's own backends (accepted only where they change nothing here).
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_PARAM = "structured_outputs"


def structured_outputs_spec(value: dict[str, Any] | None) -> StructuredSpec | None:
    """The constraint of vLLM's `structured_outputs` ({"json": schema | str} / {"regex": str}
    / {"choice": [str, ...]} / {"grammar": EBNF or Lark} / {"json_object": true}), checked
    like `response_format`; 400s name `structured_outputs.<key>`."""
    if value is None:
        return None
    unknown = sorted(set(value) - set(_SO_KINDS))
    if unknown:
        name = f"{_SO_PARAM}.{unknown[0]}"  # as a nested unknown field (errors.py)
        raise bad_request(f"Unrecognized argument supplied: '{name}'.", name)
    given = [k for k in _SO_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise bad_request(f"Invalid '{_SO_PARAM}': exactly one of {', '.join(_SO_KINDS)} "
                          f"must be set, got {len(given)}.", _SO_PARAM, "invalid_value")
    kind = given[0]
    item, param = value[kind], f"{_SO_PARAM}.{kind}"
    if kind == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except ValueError:
                item = None
        if not isinstance(item, dict):
            raise bad_request(f"Invalid '{param}': expected a JSON schema (an object or its "
                              "JSON text).", param, "invalid_value")
        return checked_spec(item, param)
    if kind == "json_object":
        if item is not True:
            raise bad_request(f"Invalid '{param}': expected true.", param, "invalid_type")
        return checked_spec({"type": "object"}, param)
    if kind == "choice":
        if not (isinstance(item, list) and item and all(isinstance(c, str) for c in item)):
            raise bad_request(f"Invalid '{param}': expected a non-empty array of strings.",
                              param, "invalid_value")
        return check_spec(StructuredSpec("choice", json.dumps(item)), param)
    if not isinstance(item, str) or not item.strip():
        raise bad_request(f"Invalid '{param}': expected a non-empty string.", param,
                          "invalid_type")
    if kind == "regex":
        return check_spec(StructuredSpec("regex", item), param)
    from llguidance.gbnf_to_lark import any_to_lark  # vLLM's grammars are GBNF (xgrammar)

    try:
        lark = any_to_lark(item)
    except Exception as exc:  # the converter raises its own errors and plain ones
        raise bad_request(f"Invalid '{param}': the grammar cannot be parsed: "
                          f"{_first_line(str(exc))}", param, "invalid_value") from None
    return check_spec(StructuredSpec("lark", lark), param)
