"""Speculative decoding of structured output (engine/spec/): the grammar cuts a draft at
the first token it refuses before the draft is scheduled (RequestGrammar.valid_prefix),
verification masks row j with the grammar advanced past the j kept drafts, and the output
is the one without speculation, greedy and seeded."""

from __future__ import annotations

import json

import pytest
from helpers.engine import assert_pool_clean, make_llm, prompt
from helpers.spec import ReferenceProposer, spec_counts, spec_llm

from plait import SamplingParams
from plait.engine import StructuredSpec
from plait.engine.grammar import GrammarCompiler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"type": "object",
         "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0,
                                                          "maximum": 99},
                        "s": {"type": "string", "maxLength": 6}},
         "required": ["k", "v", "s"], "additionalProperties": False,
         "x-guidance": {"whitespace_pattern": ""}}
SPEC = StructuredSpec("json_schema", json.dumps(SMALL))


def test_valid_prefix_stops_at_the_first_refused_token(tokenizer) -> None:
    compiler = GrammarCompiler(lambda: tokenizer, eos_ids=(2,))
    spec = StructuredSpec("regex", r"[0-9]{3}-[a-z]{2}")
    compiler.submit(spec).result()
    grammar = compiler.grammar(spec)
    digits = tokenizer.encode("123", add_special_tokens=False)
    dash = tokenizer.encode("-", add_special_tokens=False)
    letters = tokenizer.encode("ab", add_special_tokens=False)
    good = digits + dash + letters
    assert grammar.valid_prefix(good) == len(good)
    assert grammar.valid_prefix(digits + letters + dash) == len(digits)
    assert grammar.valid_prefix([*good, 2]) == len(good)  # EOS ends the count
    assert grammar.valid_prefix([2, *good]) == 0
    assert grammar.valid_prefix([]) == 0
    assert grammar.accept(digits[0])  # the state was left where it was
    assert grammar.valid_prefix(digits[1:] + dash) == len(digits) - 1 + len(dash)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=48, structured=SPEC),
    SamplingParams(temperature=1.0, top_k=10, seed=4, n=2, max_tokens=48, structured=SPEC)])
def test_structured_output_equal(tiny_path, params: SamplingParams) -> None:
    prompts = [prompt(30, 9), prompt(31, 17)]
    plain = [o.outputs for o in make_llm(tiny_path).generate(prompts, params)]
    refs = [p + c.token_ids for p, outs in zip(prompts, plain, strict=True) for c in outs]
    proposer = ReferenceProposer(refs, wrong_every=4)
    llm = spec_llm(tiny_path, proposer)
    spec = [o.outputs for o in llm.generate(prompts, params)]
    assert [[(c.token_ids, c.text, c.finish_reason) for c in outs] for outs in spec] == \
        [[(c.token_ids, c.text, c.finish_reason) for c in outs] for outs in plain]
    for outs in spec:
        for c in outs:
            assert c.finish_reason == "stop"
            json.loads(c.text)
    _, draft_tokens, accepted = spec_counts(llm)
    assert accepted > 0
    # every 4th drafted token is wrong: the grammar refuses most of those before they are
    # verified, so fewer than 1 in 4 verified draft tokens is rejected
    assert draft_tokens - accepted < draft_tokens / 4
    assert_pool_clean(llm)
