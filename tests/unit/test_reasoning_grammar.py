"""reasoning_grammar.widened: a JSON constraint with the reasoning block allowed first,
checked with llguidance on the default tokenizer: exact texts accepted and refused."""

from __future__ import annotations

import json

import pytest

from plait.engine import StructuredSpec
from plait.engine.structured import grammar_text
from plait.server.constrained.grammars import checked_spec
from plait.server.constrained.reasoning_grammar import widened
from plait.server.reasoning import REASONING_FORMATS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def accepts(tokenizer):
    import llguidance.hf
    from llguidance import LLMatcher

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def check(spec: StructuredSpec, text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, grammar_text(spec), log_level=0)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and not matcher.is_error() and matcher.is_accepting()
    return check


@pytest.mark.parametrize(("text", "ok"), [
    ('<think>\nplan {"a": "x"}\n</think>\n\n{"a":1}', True),
    ('{"a":1}', True),  # qwen3: the block is optional
    ('<think>a</think>b</think>{"a":1}', False),  # nothing between </think> and the JSON
    ('<think>a</think>{"b":1}', False),  # the schema still binds
    ("<think>a</think>", False), ("Sure.", False),
])
def test_qwen3_block_then_the_schema(accepts, text, ok) -> None:
    spec = widened(checked_spec(SCHEMA, "response_format"), REASONING_FORMATS["qwen3"], "p")
    assert accepts(spec, text) is ok


@pytest.mark.parametrize(("text", "ok"), [
    ('plan</think>\n{"a":1}', True), ('<think>plan</think>{"a":1}', True),
    ('{"a":1}', False),  # the template opened <think>: it must be closed first
    ('plan</think>[1]', False),
])
def test_deepseek_r1_starts_inside(accepts, text, ok) -> None:
    spec = widened(StructuredSpec("json_object"), REASONING_FORMATS["deepseek_r1"], "p")
    assert accepts(spec, text) is ok


def test_only_json_constraints_are_widened() -> None:
    fmt = REASONING_FORMATS["qwen3"]
    assert widened(StructuredSpec("regex", "[a-z]+"), fmt, "p") is None
    assert widened(StructuredSpec("choice", json.dumps(["a"])), fmt, "p") is None
    assert widened(StructuredSpec("lark", 'start: "a"'), fmt, "p") is None
