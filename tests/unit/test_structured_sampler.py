"""Structured output below the engine: grammar compilation, the token mask, and the
sampler's rule (a pick the grammar allows is kept; a refused one is redrawn under the mask)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from plait.engine.grammar import GrammarCompiler, GrammarError, allowed_tokens
from plait.engine.sampler import Sampler, SamplingMetadata
from plait.engine.sampling_params import SamplingParams
from plait.engine.structured import StructuredSpec

VOCAB = 49152  # the default model's tokenizer
EOS = 2
YES_NO = StructuredSpec("choice", json.dumps(["yes", "no"]))
ANY_TEXT = StructuredSpec("regex", r"(.|\n)*")


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, cache_size=2)


def compiled(compiler: GrammarCompiler, spec: StructuredSpec):
    compiler.submit(spec).result(timeout=60)
    return compiler.grammar(spec)


def meta(params: list[SamplingParams], grammars, outputs=None, generators=None):
    n = len(params)
    return SamplingMetadata(params=params, generators=generators or [None] * n,
                            prompt_token_ids=[[5]] * n, output_token_ids=outputs or [[]] * n,
                            eos_token_ids=(EOS,), grammars=grammars)


def test_the_mask_is_the_grammars_and_padding_columns_are_never_allowed(
        compiler, tokenizer) -> None:
    grammar = compiled(compiler, YES_NO)
    allowed = allowed_tokens([grammar], VOCAB + 100, torch.device("cpu"))  # [1, VOCAB + 100]
    assert allowed.shape == (1, VOCAB + 100)
    ids = allowed[0].nonzero().flatten().tolist()
    assert ids and not allowed[0, VOCAB:].any()
    # every allowed token is a prefix of "yes" or "no", and the first tokens of both are in
    texts = [tokenizer.decode([t]) for t in ids]
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts)
    for word in ("yes", "no"):
        assert tokenizer.encode(word, add_special_tokens=False)[0] in ids
    assert [grammar.allows(t) for t in ids] == [True] * len(ids)
    assert not grammar.allows(VOCAB + 5) and not grammar.allows(EOS)


def test_eos_is_allowed_exactly_when_the_grammar_is_complete(compiler, tokenizer) -> None:
    grammar = compiled(compiler, YES_NO)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert not grammar.allows(EOS)
        assert grammar.accept(token)
    assert grammar.ended and grammar.allows(EOS)
    mask = allowed_tokens([grammar], VOCAB, torch.device("cpu"))[0]
    assert mask.nonzero().flatten().tolist() == [EOS]


def test_every_engine_eos_ends_a_complete_grammar(tokenizer) -> None:
    """The engine stops on the model config's EOS ids as well as the tokenizer's: a
    complete grammar allows each of them (here id 0 besides the tokenizer's 2), not only
    the tokenizer's, or a model's natural end of turn would be redrawn away."""
    engine_eos = GrammarCompiler(lambda: tokenizer, eos_ids=(0, EOS))
    default = GrammarCompiler(lambda: tokenizer)
    spec = StructuredSpec("regex", "a+")
    grammars = [compiled(c, spec) for c in (engine_eos, default)]
    for grammar in grammars:
        assert grammar.accept(tokenizer.encode("a", add_special_tokens=False)[0])
        assert not grammar.ended and grammar.allows(EOS)
    assert grammars[0].allows(0) and not grammars[1].allows(0)


def test_each_grammar_is_a_fresh_matcher_of_one_cached_compile(compiler, tokenizer) -> None:
    first, second = compiled(compiler, YES_NO), compiled(compiler, YES_NO)
    token = tokenizer.encode("no", add_special_tokens=False)[0]
    assert first.accept(token)
    assert second.allows(tokenizer.encode("yes", add_special_tokens=False)[0])
    before = compiler.num_compiled
    compiled(compiler, YES_NO)
    assert compiler.num_compiled == before  # served from the LRU


def test_a_bad_grammar_fails_its_future_with_the_reason(compiler) -> None:
    future = compiler.submit(StructuredSpec("regex", "a("))
    with pytest.raises(GrammarError, match="unclosed group"):
        future.result(timeout=60)
    with pytest.raises(GrammarError, match="not valid JSON"):
        compiler.submit(StructuredSpec("json_schema", "{nope")).result(timeout=60)


def test_an_evicted_grammar_is_compiled_again_on_demand(compiler, tokenizer) -> None:
    specs = [StructuredSpec("regex", f"[a-z]{{{i}}}") for i in (1, 2, 3)]  # cache holds 2
    for spec in specs:
        compiler.submit(spec).result(timeout=60)
    before = compiler.num_compiled
    grammar = compiler.grammar(specs[0])  # evicted: compiled here, still correct
    assert compiler.num_compiled == before + 1
    assert grammar.allows(tokenizer.encode("a", add_special_tokens=False)[0])
    assert not grammar.allows(tokenizer.encode("ab", add_special_tokens=False)[0])
    assert not grammar.allows(EOS)


def peaked(token_ids: list[int], values: list[float]) -> torch.Tensor:
    """[len(token_ids) rows of one vocab] logits: 0 everywhere, `values[i]` at token i."""
    logits = torch.zeros(len(token_ids), VOCAB)
    for row, (token, value) in enumerate(zip(token_ids, values, strict=True)):
        logits[row, token] = value
    return logits


def test_greedy_keeps_an_allowed_argmax_and_masks_a_refused_one(compiler, tokenizer) -> None:
    yes = tokenizer.encode("yes", add_special_tokens=False)[0]
    no = tokenizer.encode("no", add_special_tokens=False)[0]
    other = tokenizer.encode(" cat", add_special_tokens=False)[0]
    logits = peaked([yes, other], [9.0, 9.0])
    logits[1, no] = 5.0  # row 1: argmax " cat" is refused; "no" is the best allowed token
    greedy = SamplingParams(temperature=0, logprobs=0)
    out = Sampler()(logits, meta([greedy] * 2, [compiled(compiler, YES_NO)] * 2))
    assert out.token_ids == [yes, no]
    # logprobs are read before the grammar mask: the unmasked distribution's value
    expected = torch.log_softmax(logits[1], dim=-1)[no].item()
    assert out.logprobs[1] is not None and math.isclose(out.logprobs[1].logprob, expected,
                                                        rel_tol=1e-6)


def test_a_seeded_draw_the_grammar_allows_is_unchanged(compiler) -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 4

    def draw(grammars):
        gen = torch.Generator().manual_seed(11)
        return Sampler()(logits, meta([params], grammars, generators=[gen])).token_ids[0]

    free = draw(None)
    grammar = compiled(compiler, ANY_TEXT)
    assert grammar.allows(free)  # precondition: the permissive grammar allows this draw
    assert draw([grammar]) == free


def test_min_tokens_does_not_block_the_eos_a_complete_grammar_needs(
        compiler, tokenizer) -> None:
    grammar = compiled(compiler, YES_NO)
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert grammar.accept(token)
    logits = torch.zeros(2, VOCAB)
    params = [SamplingParams(temperature=0, min_tokens=10, max_tokens=20),
              SamplingParams(temperature=1.0, min_tokens=10, max_tokens=20)]
    out = Sampler()(logits, meta(params, [grammar, grammar], outputs=[[7], [7]]))
    assert out.token_ids == [EOS, EOS]  # the grammar wins over min_tokens, no NaN row


def test_a_matcher_in_error_fails_the_sampling_call(compiler, tokenizer) -> None:
    grammar = compiled(compiler, YES_NO)
    assert not grammar.accept(tokenizer.encode(" cat", add_special_tokens=False)[0])
    assert grammar.error
    with pytest.raises(ValueError, match="allows no token"):
        Sampler()(torch.zeros(1, VOCAB), meta([SamplingParams(temperature=0)], [grammar]))
