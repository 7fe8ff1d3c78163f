"""Speculative decoding changes nothing a request asks for (engine/spec/verify.py): seeded
sampling gives the same tokens as without speculation, and so do logprobs, top_logprobs,
penalties, min_tokens, EOS, stop tokens, stop strings, max_tokens and n > 1 with seeds.
Drafts come from the run without speculation, every third token wrong, so rows are both
accepted and rejected (helpers/spec.py).

Sampled runs use top_k or top_p: a row of a speculative chunk differs from a one-row
decode's by float rounding (about 1e-6, see engine/spec/verify.py), which in the random
model's flat tail can move a pick to its neighbour in the inverse CDF."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.engine import EOS, assert_pool_clean, make_llm, prompt
from helpers.spec import ReferenceProposer, spec_counts, spec_llm

from plait import LLM, SamplingParams
from plait.engine.outputs import CompletionOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [prompt(11, 7), prompt(12, 13), prompt(13, 4)]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=5)


def compare(tiny_path, params: SamplingParams, prompts=PROMPTS, wrong_every: int = 3
            ) -> tuple[list[list[CompletionOutput]], list[list[CompletionOutput]], LLM]:
    """Each prompt's choices without and with speculation, and the speculating LLM."""
    plain = [o.outputs for o in make_llm(tiny_path).generate(prompts, params)]
    refs = [p + c.token_ids for p, outs in zip(prompts, plain, strict=True) for c in outs]
    llm = spec_llm(tiny_path, ReferenceProposer(refs, wrong_every))
    spec = [o.outputs for o in llm.generate(prompts, params)]
    return plain, spec, llm


def fields(outs: list[list[CompletionOutput]]) -> list[list[tuple]]:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in choices]
            for choices in outs]


def assert_logprobs_equal(plain, spec) -> None:
    for a_choices, b_choices in zip(plain, spec, strict=True):
        for a, b in zip(a_choices, b_choices, strict=True):
            assert a.logprobs is not None and b.logprobs is not None
            assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert (x.token_id, [t for t, _ in x.top]) == (y.token_id, [t for t, _ in y.top])
                assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
                assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-4)


def test_seeded_sampling_same_tokens_and_logprobs(tiny_path) -> None:
    params = replace(SAMPLED, logprobs=3)
    plain, spec, llm = compare(tiny_path, params)
    assert fields(spec) == fields(plain)
    assert_logprobs_equal(plain, spec)
    _, draft_tokens, accepted = spec_counts(llm)
    assert 0 < accepted < draft_tokens
    assert_pool_clean(llm)


def test_n_choices_with_seed_equal_single_choices(tiny_path) -> None:
    params = replace(SAMPLED, n=3, seed=40)
    plain, spec, llm = compare(tiny_path, params, PROMPTS[:2])
    assert fields(spec) == fields(plain)
    for index in range(3):
        alone = llm.generate(PROMPTS[:2], replace(params, n=1, seed=40 + index))
        assert [o.outputs[0].token_ids for o in alone] == [s[index].token_ids for s in spec]
    assert len({tuple(c.token_ids) for c in spec[0]}) == 3  # the choices differ
    assert_pool_clean(llm)


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.6), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
    dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_penalties_see_accepted_tokens_one_at_a_time(tiny_path, penalties, temperature) -> None:
    # a prompt that repeats, so penalties change the picks
    repeat = prompt(21, 3) * 4
    # top_k: the random model's flat tail would let float rounding (verify.py) move a pick
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True,
                            logprobs=2, top_k=8, **penalties)
    plain, spec, llm = compare(tiny_path, params, [repeat, PROMPTS[1]], wrong_every=4)
    assert fields(spec) == fields(plain)
    assert_logprobs_equal(plain, spec)
    # without penalties the same drafts give other tokens: the penalties matter here
    bare = make_llm(tiny_path).generate([repeat, PROMPTS[1]],
                                        replace(params, repetition_penalty=1.0,
                                                frequency_penalty=0.0, presence_penalty=0.0))
    assert [o.outputs[0].token_ids for o in bare] != [s[0].token_ids for s in spec]
    assert spec_counts(llm)[2] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eos_min_tokens_and_stop_token_ids(tiny_path, temperature) -> None:
    # EOS made likely by a bias: min_tokens holds it off, then it stops the request
    params = SamplingParams(temperature=temperature, seed=9, max_tokens=30, min_tokens=6,
                            logit_bias={EOS: 9.0}, top_k=8)
    plain, spec, llm = compare(tiny_path, params, wrong_every=5)
    assert fields(spec) == fields(plain)
    lengths = [c.token_ids for choices in plain for c in choices]
    assert all(len(t) >= 6 for t in lengths)
    assert any(c.finish_reason == "stop" and c.token_ids[-1] == EOS
               for choices in plain for c in choices)
    # stop token ids taken from an unbiased output (no min_tokens: the same trajectory)
    free = replace(params, logit_bias=None, ignore_eos=True, min_tokens=0)
    outs = [o.outputs[0].token_ids for o in make_llm(tiny_path).generate(PROMPTS, free)]
    stop = replace(free, stop_token_ids=[outs[0][9], outs[1][2]])
    plain, spec, llm = compare(tiny_path, stop, wrong_every=5)
    assert fields(spec) == fields(plain)
    assert [choices[0].stop_reason for choices in plain[:2]] == [outs[0][9], outs[1][2]]
    assert_pool_clean(llm)


def test_stop_strings_and_max_tokens(tiny_path) -> None:
    base = replace(SAMPLED, max_tokens=18)
    plain = make_llm(tiny_path).generate(PROMPTS, base)
    text = plain[1].outputs[0].text
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    for params in (replace(base, stop=[stop_str]),
                   replace(base, stop=[stop_str], include_stop_str_in_output=True),
                   replace(base, max_tokens=5), replace(base, max_tokens=1)):
        a, b, llm = compare(tiny_path, params, wrong_every=0)
        assert fields(b) == fields(a)
    assert any(c.finish_reason == "stop" and c.stop_reason == stop_str
               for choices in a for c in choices) or params.max_tokens == 1
    assert_pool_clean(llm)
