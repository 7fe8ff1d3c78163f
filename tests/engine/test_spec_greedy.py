"""Speculative decoding keeps greedy output token for token (engine/spec/): drafts that
are right, wrong at one token, or wrong everywhere, on a tiny random model."""

from __future__ import annotations

import pytest
from helpers.engine import assert_pool_clean, make_llm, prompt
from helpers.spec import ReferenceProposer, spec_counts, spec_llm

from plait import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def reference(tiny_path, prompts, params):
    llm = make_llm(tiny_path)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("wrong_every", [0, 3, 1])
def test_greedy_equal_whatever_the_drafts(tiny_path, wrong_every: int) -> None:
    prompts = [prompt(1, 9), prompt(2, 14), prompt(3, 5)]
    want = reference(tiny_path, prompts, PARAMS)
    proposer = ReferenceProposer([p + w for p, w in zip(prompts, want, strict=True)],
                                 wrong_every)
    llm = spec_llm(tiny_path, proposer)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    assert got == want
    drafts, draft_tokens, accepted = spec_counts(llm)
    assert drafts == len(proposer.verified) > 0
    assert draft_tokens == sum(p for _, p, _ in proposer.verified)
    assert accepted == sum(a for _, _, a in proposer.verified)
    if wrong_every == 0:
        assert accepted == draft_tokens  # every draft right
        assert drafts < 3 * 23 / 2  # several tokens per step
    elif wrong_every == 1:
        assert accepted == 0
    else:
        assert 0 < accepted < draft_tokens
    assert_pool_clean(llm)
