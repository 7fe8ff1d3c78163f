"""Prefill once for n choices: exact counters, equality with solo runs, copy-on-write."""

from __future__ import annotations

import random

import pytest
from helpers.engine import (
    SHARING,
    assert_pool_clean,
    make_llm,
    prompt,
    run_until_done,
    solo_tokens,
    tokens_of,
)

from plait import SamplingParams

PROMPT_LEN = 60  # block_size 16: 3 full blocks + a partial block of 12 tokens


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_same_step_arrival_computes_prompt_once(tiny_path) -> None:
    llm = make_llm(tiny_path, **SHARING)
    ids = prompt(1, PROMPT_LEN)
    for i in range(8):
        llm.engine.add_request(f"r{i}", ids, GREEDY)
    seen = run_until_done(llm)
    stats = llm.stats()
    assert stats.prompt_tokens_computed == PROMPT_LEN
    assert stats.prompt_tokens_cached == 7 * PROMPT_LEN
    first_steps = seen.first_step
    assert set(first_steps.values()) == {0}, "all choices get their first token in one step"
    cached = sorted(deltas[-1].num_cached_tokens for deltas in seen.values())
    assert cached == [0] + [PROMPT_LEN] * 7


def test_n_fanout_through_llm_generate(tiny_path) -> None:
    llm = make_llm(tiny_path, **SHARING)
    params = SamplingParams(n=100, temperature=1.0, seed=5, max_tokens=1)
    out = llm.generate([prompt(2, PROMPT_LEN)], params)
    assert len(out[0].outputs) == 100
    assert llm.stats().prompt_tokens_computed == PROMPT_LEN
    assert out[0].num_cached_tokens == 99 * PROMPT_LEN


def test_arrival_during_chunked_prefill(tiny_path) -> None:
    llm = make_llm(tiny_path, **{**SHARING, "max_num_batched_tokens": 16})
    ids = prompt(3, PROMPT_LEN)
    llm.engine.add_request("owner", ids, GREEDY)
    llm.engine.step()  # owner computes tokens 0..15
    llm.engine.step()  # 16..31
    llm.engine.add_request("late", ids, GREEDY)
    seen = run_until_done(llm)
    stats = llm.stats()
    assert stats.prompt_tokens_computed == PROMPT_LEN
    assert stats.prompt_tokens_cached == PROMPT_LEN
    assert seen.first_step["late"] == seen.first_step["owner"], "first tokens in the same step"
    assert seen["late"][-1].num_cached_tokens == PROMPT_LEN
    expected = solo_tokens(tiny_path, ids, GREEDY, **SHARING)
    assert tokens_of(seen["late"]) == tokens_of(seen["owner"]) == expected


def test_arrival_after_completion_skips_forward(tiny_path) -> None:
    llm = make_llm(tiny_path, **SHARING)
    ids = prompt(4, PROMPT_LEN)
    first = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    computed_before = llm.stats().prompt_tokens_computed
    llm.engine.add_request("again", ids, GREEDY)
    deltas = llm.engine.step().deltas  # samples from the kept logits row: no forward pass
    assert [d.request_id for d in deltas] == ["again"]
    assert llm.engine.counters.steps == len(first) + 1
    seen = run_until_done(llm)
    assert llm.stats().prompt_tokens_computed == computed_before == PROMPT_LEN
    assert deltas[0].token_ids + tokens_of(seen["again"]) == first
    assert deltas[0].num_cached_tokens == PROMPT_LEN


@pytest.mark.parametrize("length,recomputed", [(PROMPT_LEN, 12), (64, 16)])
def test_evicted_logits_recompute_only_last_block(tiny_path, length, recomputed) -> None:
    llm = make_llm(tiny_path, **{**SHARING, "max_shared_logits": 0})
    ids = prompt(5, length)
    first = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert llm.stats().shared_prompts_kept == 0
    again = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert again == first
    assert llm.stats().prompt_tokens_computed == length + recomputed


def test_shared_choices_equal_solo_runs(tiny_path) -> None:
    ids = prompt(6, PROMPT_LEN)
    llm = make_llm(tiny_path, **SHARING)
    seeded = SamplingParams(n=4, temperature=1.0, seed=100, max_tokens=8, ignore_eos=True)
    out = llm.generate([ids], seeded)[0].outputs
    for i, choice in enumerate(out):
        params = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=8, ignore_eos=True)
        alone = solo_tokens(tiny_path, ids, params, **SHARING)
        assert choice.token_ids == alone
    assert len({tuple(c.token_ids) for c in out}) > 1, "different seeds give different tokens"
    greedy = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    expected = solo_tokens(tiny_path, ids, greedy.for_choice(0), **SHARING)
    assert [c.token_ids for c in llm.generate([ids], greedy)[0].outputs] == [expected] * 3


def test_copy_on_write_keeps_choices_apart(tiny_path) -> None:
    """Two choices forced to different first tokens share the partial block; each must
    continue exactly as it does alone (a leak of one's token into the other's KV would
    change its continuation)."""
    ids = prompt(7, PROMPT_LEN)
    llm = make_llm(tiny_path, **SHARING)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                             logit_bias={tok: 100.0}) for tok in (1000, 2000)]
    # the bias only steers the first token: later tokens are greedy on clean logits
    for i, p in enumerate(params):
        p.logit_bias = {1000 + 1000 * i: 100.0}
    llm.engine.add_request("a", ids, params[0])
    llm.engine.add_request("b", ids, params[1])
    seen = run_until_done(llm)
    assert llm.stats().prompt_tokens_computed == PROMPT_LEN
    for rid, p in zip("ab", params, strict=True):
        assert tokens_of(seen[rid]) == solo_tokens(tiny_path, ids, p, **SHARING)


def test_abort_of_computing_owner_does_not_strand_followers(tiny_path) -> None:
    llm = make_llm(tiny_path, **{**SHARING, "max_num_batched_tokens": 16})
    ids = prompt(8, PROMPT_LEN)
    llm.engine.add_request("owner", ids, GREEDY)
    llm.engine.add_request("f1", ids, GREEDY)
    llm.engine.add_request("f2", ids, GREEDY)
    llm.engine.step()  # owner computes block 0; f1 and f2 are parked on it
    llm.engine.abort("owner")
    seen = run_until_done(llm)
    expected = solo_tokens(tiny_path, ids, GREEDY, **SHARING)
    assert tokens_of(seen["f1"]) == tokens_of(seen["f2"]) == expected
    # block 0 was computed by the aborted owner and reused: the prompt is still computed once
    assert llm.stats().prompt_tokens_computed == PROMPT_LEN


def test_mixed_sampling_params_share_one_prefill(tiny_path) -> None:
    ids = prompt(9, PROMPT_LEN)
    llm = make_llm(tiny_path, **SHARING)
    mixed = [GREEDY, SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=6),
             SamplingParams(temperature=1.3, top_k=5, seed=2, max_tokens=6, logprobs=2)]
    for i, p in enumerate(mixed):
        llm.engine.add_request(f"m{i}", ids, p)
    seen = run_until_done(llm)
    assert llm.stats().prompt_tokens_computed == PROMPT_LEN
    for i, p in enumerate(mixed):
        assert tokens_of(seen[f"m{i}"]) == solo_tokens(tiny_path, ids, p, **SHARING)


def test_prompt_logprobs_request_computes_its_own_prefill(tiny_path) -> None:
    ids = prompt(10, PROMPT_LEN)
    llm = make_llm(tiny_path, **SHARING)
    llm.generate([ids], GREEDY)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    assert llm.stats().prompt_tokens_computed == 2 * PROMPT_LEN
    assert len(out[0].prompt_logprobs) == PROMPT_LEN and out[0].prompt_logprobs[0] is None


def test_preemption_and_sharing_stress(tiny_path) -> None:
    """Duplicated prompts, a tiny pool and chunking: everything equals its solo run and
    every block is released at the end."""
    llm = make_llm(tiny_path, **{**SHARING, "num_kv_blocks": 12, "max_num_batched_tokens": 32,
                                 "max_num_seqs": 8})
    rng = random.Random(0)
    prompts = [prompt(20 + i, rng.randrange(20, 90)) for i in range(5)]
    jobs = []
    for i in range(16):
        ids = prompts[rng.randrange(len(prompts))]
        params = SamplingParams(temperature=0.9, seed=i, max_tokens=rng.randrange(4, 20),
                                ignore_eos=True)
        jobs.append((f"j{i}", ids, params))
        llm.engine.add_request(f"j{i}", ids, params)
    seen = run_until_done(llm)
    assert llm.stats().num_preemptions > 0
    for rid, ids, params in jobs:
        assert tokens_of(seen[rid]) == solo_tokens(tiny_path, ids, params, **SHARING), rid
    assert_pool_clean(llm)
