"""Structured output after reasoning: a JSON grammar (response_format, tool_choice required
or named) widened so that the <think> block of a --reasoning-parser comes first, free, and
the JSON after it is bound as before.

    qwen3         start: THINK? answer     THINK: "<think>" BODY "</think>" WS
    deepseek_r1   start: THINK answer      THINK: BODY "</think>" WS   (the template opened
                                                                        <think>)
    BODY          any text without "</think>" (llguidance's `&` and `~` on terminals)
    answer        %json <the same schema>

Only JSON constraints are widened; a regex, choice or Lark grammar (vLLM's
structured_outputs, tool_choice auto without a tool template) binds the output from its
first token, so such a request gets no reasoning split (`widened` returns None).
"""

from __future__ import annotations

import json

from plait.engine import StructuredSpec
from plait.engine.structured import JSON_WHITESPACE
from plait.server.constrained.grammars import check_spec
from plait.server.reasoning import ReasoningFormat

_BODY = r"BODY: /(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/"
_WS = r"/[ \t\r\n]*/"


def _schema_text(spec: StructuredSpec) -> str | None:
    if spec.kind == "json_schema":
        return spec.value
    if spec.kind == "json_object":  # the engine's own json_object whitespace
        return json.dumps({"type": "object",
                           "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})
    return None


def widened(spec: StructuredSpec, fmt: ReasoningFormat, param: str) -> StructuredSpec | None:
    """`spec` with `fmt`'s reasoning block allowed before it, compiled and checked (a 400
    naming `param` if it does not compile); None when `spec` is not a JSON constraint."""
    schema = _schema_text(spec)
    if schema is None:
        return None
    if fmt.starts_inside:
        start, think = "start: THINK answer", f'THINK: BODY "</think>" {_WS}'
    else:
        start, think = "start: THINK? answer", f'THINK: "<think>" BODY "</think>" {_WS}'
    lark = f"{start}\n{_BODY}\n{think}\nanswer: %json {schema}\n"
    return check_spec(StructuredSpec("lark", lark), param)
