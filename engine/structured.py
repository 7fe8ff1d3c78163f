"""What a request's output must match (structured output), as plain data.

A `StructuredSpec` travels with `SamplingParams` from the HTTP layer to the engine (across
the process boundary, so it is a frozen dataclass of strings). The engine compiles it into a
grammar matcher per sub-request (llguidance); the HTTP layer only builds and checks specs.

Kinds:
    "json_schema"  value = a JSON Schema, as JSON text
    "json_object"  value = "" (any JSON object)
    "regex"        value = a regular expression the whole output must match
    "choice"       value = a JSON array of strings; the output is exactly one of them
    "lark"         value = an llguidance Lark grammar (may embed %json{...} schemas)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

# Whitespace allowed between JSON tokens: one optional line break, then up to 24 spaces or
# tabs. Pretty-printed JSON still fits, but a model cannot loop on whitespace (llguidance's
# default, any run of whitespace, lets a small model emit newlines until max_tokens).
JSON_WHITESPACE = r"(?:\r?\n)?[\x20\x09]{0,24}"

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
# The start of the `error` of a request whose grammar the engine could not compile (the
# HTTP layer answers it with a 400: the grammar came from the client).
GRAMMAR_FAILED = "the structured output grammar cannot be compiled"
STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """One output constraint. Equal specs compile to the same grammar (cache key)."""

    kind: StructuredKind
    value: str = ""


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar (its JSON grammar text) for `spec`.

    Raises `ValueError` with a client-readable reason when the spec is malformed (bad
    JSON, a choice list that is not a list of strings, an unknown kind)."""
    from llguidance import LLMatcher

    if spec.kind == "json_schema":
        try:
            json.loads(spec.value)
        except ValueError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        return LLMatcher.grammar_from_json_schema(
            spec.value, defaults={"whitespace_pattern": JSON_WHITESPACE})
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults={"whitespace_pattern": JSON_WHITESPACE})
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except ValueError:
            choices = None
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise ValueError("choice must be a non-empty array of strings")
        lark = "start: " + " | ".join(json.dumps(c) for c in choices)
        return LLMatcher.grammar_from_lark(lark)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.value)
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def structured_error(spec: StructuredSpec) -> str | None:
    """Why `spec` cannot be compiled (a client-readable reason), or None when it can.

    Needs no tokenizer: the HTTP layer calls it to answer a bad schema with a 400 before
    the request reaches the engine."""
    try:
        grammar = grammar_text(spec)
    except ValueError as exc:
        return str(exc)
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    return error or None
