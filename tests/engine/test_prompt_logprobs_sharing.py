"""Prompt logprobs for n choices: scored once by the owner, copied to its followers, exact.

An n>1 request with `prompt_logprobs` (or completions `echo` + `logprobs`) fans out into n
sub-requests with the same prompt and the same `prompt_logprobs`. They share one prefill
like any identical prompts (prompt_share.py), under a key of their own, and every one of
them returns the owner's scores, equal to what the prompt alone gives.
"""

from __future__ import annotations

import pytest
from helpers.engine import (
    SHARING,
    assert_pool_clean,
    make_llm,
    prompt,
    run_until_done,
    solo,
    tokens_of,
)

from plait import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_LEN = 60  # block_size 16: 3 full blocks + a partial block of 12 tokens
SCORED = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)


def scores(entries) -> list[tuple | None]:
    """Everything a prompt-logprob entry carries, comparable with ==."""
    return [None if e is None else (e.token_id, e.logprob, tuple(e.top), e.rank)
            for e in entries]


def solo_scores(path, ids: list[int], params: SamplingParams) -> tuple[list, list[int]]:
    """(prompt scores, tokens) of this prompt run alone, with caching and sharing off."""
    out = solo(path, ids, params, **SHARING)
    return scores(out.prompt_logprobs), out.outputs[0].token_ids


def first_scores(seen, request_id: str) -> list:
    deltas = seen[request_id]
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    return scores(deltas[0].prompt_logprobs)


def test_n_choices_score_the_prompt_once_and_equal_a_solo_run(tiny_path) -> None:
    llm = make_llm(tiny_path, **SHARING)
    ids = prompt(31, PROMPT_LEN)
    for i in range(4):
        llm.engine.add_request(f"c{i}", ids, SCORED)
    seen = run_until_done(llm)
    stats = llm.stats()
    assert stats.prompt_tokens_computed == PROMPT_LEN
    assert stats.prompt_tokens_cached == 3 * PROMPT_LEN
    assert stats.shared_prompts_kept == 0  # scored prompts are never kept
    expected_scores, expected_tokens = solo_scores(tiny_path, ids, SCORED)
    assert len(expected_scores) == PROMPT_LEN and expected_scores[0] is None
    for i in range(4):
        assert first_scores(seen, f"c{i}") == expected_scores
        assert tokens_of(seen[f"c{i}"]) == expected_tokens
    ranks = [entry[3] for entry in expected_scores[1:]]
    assert all(rank >= 1 for rank in ranks)
    for token_id, _, top, rank in expected_scores[1:]:  # rank 1..2 iff among the top 2
        assert (token_id in [t for t, _ in top]) == (rank <= 2)
    assert_pool_clean(llm)


def test_cached_prefix_is_rescored_exactly(tiny_path) -> None:
    """A prompt whose first blocks are cached (an earlier request shares 32 tokens) is
    still scored whole, once for all choices, and equals its solo scores."""
    llm = make_llm(tiny_path, **SHARING)
    ids = prompt(32, PROMPT_LEN)
    llm.generate([ids[:40]], SamplingParams(temperature=0, max_tokens=1))
    computed_before = llm.stats().prompt_tokens_computed
    out = llm.generate([ids], SamplingParams(n=3, temperature=0, max_tokens=3,
                                             ignore_eos=True, prompt_logprobs=2))[0]
    assert llm.stats().prompt_tokens_computed == computed_before + PROMPT_LEN
    expected_scores, expected_tokens = solo_scores(tiny_path, ids, SCORED)
    assert scores(out.prompt_logprobs) == expected_scores
    assert [o.token_ids for o in out.outputs] == [expected_tokens] * 3


def test_arrival_during_a_chunked_scoring_prefill_shares_it(tiny_path) -> None:
    llm = make_llm(tiny_path, **{**SHARING, "max_num_batched_tokens": 16})
    ids = prompt(33, PROMPT_LEN)
    llm.engine.add_request("owner", ids, SCORED)
    llm.engine.step()  # tokens 0..15
    llm.engine.add_request("late", ids, SCORED)
    seen = run_until_done(llm)
    assert llm.stats().prompt_tokens_computed == PROMPT_LEN
    assert seen.first_step["late"] == seen.first_step["owner"], "first tokens in the same step"
    assert first_scores(seen, "late") == first_scores(seen, "owner")
    assert len(first_scores(seen, "late")) == PROMPT_LEN
    assert tokens_of(seen["late"]) == tokens_of(seen["owner"])
    assert_pool_clean(llm)


def test_scoring_requests_do_not_share_with_other_kinds(tiny_path) -> None:
    """A different `prompt_logprobs` (or none) needs other scores: each kind computes the
    prompt for itself, and a plain repeat still finds the plain prompt kept."""
    llm = make_llm(tiny_path, **SHARING)
    ids = prompt(34, PROMPT_LEN)
    kinds = {"plain": SamplingParams(temperature=0, max_tokens=2),
             "top1": SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
             "top2": SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)}
    for rid, params in kinds.items():
        llm.engine.add_request(rid, ids, params)
    seen = run_until_done(llm)
    assert llm.stats().prompt_tokens_computed == 3 * PROMPT_LEN
    assert seen["plain"][0].prompt_logprobs is None
    one, two = first_scores(seen, "top1"), first_scores(seen, "top2")
    assert [e[:2] for e in one[1:]] == [e[:2] for e in two[1:]]
    assert [e[2] for e in one[1:]] == [e[2][:1] for e in two[1:]]
    llm.generate([ids], kinds["plain"])
    assert llm.stats().prompt_tokens_computed == 3 * PROMPT_LEN  # kept: no forward pass


def test_followers_over_max_num_seqs_still_get_the_scores(tiny_path) -> None:
    """Followers that could not join the owner's step (max_num_seqs) are re-queued; with
    no kept prompt for scores, the first of them scores the prompt again, and all of them
    return the same scores."""
    llm = make_llm(tiny_path, **{**SHARING, "max_num_seqs": 2})
    ids = prompt(35, PROMPT_LEN)
    for i in range(4):
        llm.engine.add_request(f"c{i}", ids, SCORED)
    seen = run_until_done(llm)
    expected_scores, _ = solo_scores(tiny_path, ids, SCORED)
    for i in range(4):
        assert first_scores(seen, f"c{i}") == expected_scores
    assert llm.stats().prompt_tokens_computed == 2 * PROMPT_LEN
    assert_pool_clean(llm)
