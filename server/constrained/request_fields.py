"""The OpenAI shapes of `response_format`, `tools`, `tool_choice` and a message's
`tool_calls`, validated strictly (unknown keys, wrong types -> 400 naming the exact field).

`protocol.py` declares these request fields as plain JSON (`dict` / `list[dict]`), so that
this module can validate them with precise parameter names: a pydantic union of the three
`response_format` shapes would name its branch in the error location instead.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plait.server.errors import bad_request, echo, validation_error

MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`. `schema` may be absent (OpenAI: any JSON object)."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """One of {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", ...}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema; OpenAI's default for an absent one: an empty object."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(_Strict):
    """A call in an assistant message of the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


def _validate(model: type[BaseModel], value: Any, loc: tuple[Any, ...]) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *loc, *e["loc"])} for e in exc.errors()]
        raise validation_error(errors) from None


def parse_response_format(value: dict[str, Any] | None) -> ResponseFormat | None:
    """The request's `response_format`, or None when absent. 400s name the field."""
    if value is None:
        return None
    rf = _validate(ResponseFormat, value, ("response_format",))
    if rf.type == "json_schema" and rf.json_schema is None:
        raise bad_request("Missing required parameter: 'response_format.json_schema'.",
                          "response_format.json_schema", "missing_required_parameter")
    if rf.type != "json_schema" and rf.json_schema is not None:
        raise bad_request(f"Invalid 'response_format': 'json_schema' is only allowed with "
                          f"type \"json_schema\", not {echo(rf.type)}.", "response_format",
                          "invalid_value")
    return rf


def parse_tools(value: list[dict[str, Any]] | None) -> list[Tool]:
    """The request's `tools` (an empty list when absent). Names must be unique."""
    if value is None:
        return []
    if len(value) > MAX_TOOLS:
        raise bad_request(f"Invalid 'tools': array too long. Expected an array with maximum "
                          f"length {MAX_TOOLS}, but got an array with length {len(value)} "
                          "instead.", "tools", "array_above_max_length")
    tools = [_validate(Tool, t, ("tools", i)) for i, t in enumerate(value)]
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise bad_request(f"Invalid 'tools.[{i}].function.name': the function name "
                              f"{echo(tool.function.name)} is used by more than one tool.",
                              f"tools.[{i}].function.name", "invalid_value")
        seen.add(tool.function.name)
    return tools


def parse_tool_choice(value: str | dict[str, Any] | None, tools: list[Tool]) -> str | None:
    """"none" | "auto" | "required", or the forced function's name; None when absent and
    there are no tools. Defaults as OpenAI: "auto" with tools, "none" without."""
    if value is None:
        return "auto" if tools else None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(f"Invalid value for 'tool_choice': {echo(value)}. Expected "
                              '"none", "auto", "required" or {"type": "function", '
                              '"function": {"name": ...}}.', "tool_choice", "invalid_value")
        if value != "none" and not tools:
            raise bad_request(f"Invalid value for 'tool_choice': {echo(value)} is only "
                              "allowed when 'tools' are specified.", "tool_choice",
                              "invalid_value")
        return value
    named = _validate(NamedToolChoice, value, ("tool_choice",))
    if named.function.name not in {t.function.name for t in tools}:
        raise bad_request(f"Invalid value for 'tool_choice': no function named "
                          f"{echo(named.function.name)} in 'tools'.",
                          "tool_choice.function.name", "invalid_value")
    return named.function.name


def parse_message_tool_calls(value: list[dict[str, Any]], i: int
                             ) -> list[tuple[MessageToolCall, dict[str, Any]]]:
    """An assistant message's `tool_calls`, each with its arguments as a dict (templates
    take a dict). 400 naming `messages.[i].tool_calls...` for a bad shape or arguments that
    are not a JSON object."""
    result = []
    for j, raw in enumerate(value):
        call = _validate(MessageToolCall, raw, ("messages", i, "tool_calls", j))
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            param = f"messages.[{i}].tool_calls.[{j}].function.arguments"
            raise bad_request(f"Invalid '{param}': expected a JSON object as text.", param,
                              "invalid_value")
        result.append((call, arguments))
    return result
