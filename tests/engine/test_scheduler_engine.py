"""Scheduler inside the engine with a tiny model: preemption, chunked prefill, prefix caching,
aborts and caps, checked token for token against each request run alone, and the pool checked
for leaks afterwards. Exact block ids on a pure scheduler are in test_scheduler_unit.py.
"""

from __future__ import annotations

import random

import pytest
from helpers.engine import (
    GREEDY,
    assert_all_free,
    prompt,
    run_until_done,
    solo_tokens,
    tokens_of,
)

from plait import LLM, SamplingParams
from plait.engine.sched_output import SchedulerOutput
from plait.engine.validation import RequestRejected

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def record_schedules(llm: LLM, measure) -> list:
    """Record `measure(out)` for every `schedule()` the engine makes from now on."""
    sched = llm.engine.scheduler
    original, recorded = sched.schedule, []

    def recording_schedule(drafts=None) -> SchedulerOutput:
        out = original(drafts)
        recorded.append(measure(out))
        return out

    sched.schedule = recording_schedule
    return recorded


def assert_at_rest(llm: LLM) -> None:
    """Nothing in flight and every block back in the pool's free queue (kept prompts hold
    no block): the usage gauges read 0."""
    assert llm.engine.scheduler.share.in_flight == {}
    stats = llm.stats()
    assert (stats.kv_blocks_used, stats.kv_cache_usage) == (0, 0.0)
    assert_all_free(llm.engine.pool)


def twenty_jobs() -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"r{i}", prompt(i, 5 + 2 * i),
             SamplingParams(temperature=0, max_tokens=12 + i % 13, ignore_eos=True))
            for i in range(20)]


def test_preemption_keeps_every_token(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=24, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=64)
    jobs = twenty_jobs()
    for rid, ids, params in jobs:
        llm.engine.add_request(rid, ids, params)
    seen = run_until_done(llm)
    assert llm.stats().num_preemptions > 0
    for rid, ids, params in jobs:
        assert tokens_of(seen[rid]) == solo_tokens(tiny_path, ids, params, block_size=16), rid
        assert seen[rid][-1].finish_reason == "length"
    assert llm.stats().generation_tokens == sum(p.max_tokens for _, _, p in jobs)
    assert_at_rest(llm)


@pytest.mark.parametrize("num_steps,state", [(1, "parked"), (3, "kept"), (6, "preempted")])
def test_abort_mid_way_frees_every_block(tiny_path, num_steps: int, state: str) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=24, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=32)
    long_prompt = (prompt(99, 70), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    jobs = twenty_jobs()
    # Two copies of a long prompt (the second is parked while the first computes in chunks)
    # and a copy of a short one.
    jobs = [("long0", *long_prompt), ("long1", *long_prompt), *jobs[:6],
            ("dup", *jobs[3][1:]), *jobs[6:]]
    for rid, ids, params in jobs:
        llm.engine.add_request(rid, ids, params)
    for _ in range(num_steps):
        llm.engine.step()
    sched = llm.engine.scheduler
    states = {"parked": sum(len(e.followers) for e in sched.share.in_flight.values()),
              "kept": len(sched.share.kept),
              "preempted": sum(1 for r in sched.waiting if r.output_token_ids)}
    assert states[state] > 0
    order = [rid for rid, _, _ in jobs]
    random.Random(num_steps).shuffle(order)
    for rid in order:
        delta = llm.engine.abort(rid)
        assert (delta.request_id, delta.finish_reason, delta.token_ids) == (rid, "abort", [])
    assert llm.engine.abort(order[0]) is None
    assert not llm.engine.has_unfinished()
    assert sched.num_unfinished == 0
    assert llm.engine.step().deltas == []
    assert_at_rest(llm)
    # The engine still serves correctly after the mass abort.
    rid, ids, params = jobs[5]
    llm.engine.add_request("after", ids, params)
    after = tokens_of(run_until_done(llm)["after"])
    assert after == solo_tokens(tiny_path, ids, params, block_size=16)


def test_abort_of_waiting_and_running_request_frees_everything(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=32, block_size=4, max_num_seqs=1)
    llm.engine.add_request("run", prompt(1, 30), GREEDY)
    llm.engine.add_request("wait", prompt(2, 30), GREEDY)
    llm.engine.step()
    llm.engine.step()
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert llm.engine.abort("wait").finish_reason == "abort"
    # run's 30-token prompt: 7 full blocks + a partial one. Its first decode token went into
    # a private copy of the partial block; the original is only cached now (ref 0, named by
    # the kept prompt): 7 + 1 blocks in use.
    assert llm.stats().kv_blocks_used == 8
    assert llm.engine.abort("run").finish_reason == "abort"
    assert llm.engine.step().deltas == []
    assert llm.stats().shared_prompts_kept == 1
    assert_at_rest(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_gives_the_same_tokens(tiny_path, caching: bool) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=96, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=caching)
    jobs = [(f"c{i}", prompt(100 + i, 50 + 25 * i), GREEDY) for i in range(3)]
    for rid, ids, params in jobs:
        llm.engine.add_request(rid, ids, params)
    sizes = record_schedules(llm, lambda out: out.num_tokens)
    seen = run_until_done(llm)
    assert max(sizes) == 16
    assert llm.stats().prompt_tokens_computed == 50 + 75 + 100
    for rid, ids, params in jobs:
        assert tokens_of(seen[rid]) == solo_tokens(tiny_path, ids, params, block_size=16), rid
    if not caching:
        assert llm.stats().shared_prompts_kept == 0
    assert_at_rest(llm)


def test_engine_rejects_requests_that_can_never_fit(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=8, block_size=4)  # the pool holds 32 tokens
    assert llm.engine.info.max_model_len == 32
    with pytest.raises(RequestRejected, match="32 tokens; with one generated token that exceeds "
                       "the maximum context length of 32 tokens"):
        llm.generate([prompt(1, 32)], GREEDY)
    capped = LLM(str(tiny_path), num_kv_blocks=64, block_size=4, max_model_len=20)
    with pytest.raises(RequestRejected, match="maximum context length of 20 tokens"):
        capped.generate([prompt(1, 20)], GREEDY)
    assert not llm.engine.has_unfinished() and not capped.engine.has_unfinished()
    # One token short of the limit still runs, and stops at the context length.
    capped.engine.add_request("fits", prompt(1, 19), GREEDY)
    (delta,) = run_until_done(capped)["fits"]
    assert (len(delta.token_ids), delta.finish_reason) == (1, "length")


def test_max_num_seqs_is_never_exceeded(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=64, block_size=4, max_num_seqs=3)
    sched = llm.engine.scheduler
    counts = record_schedules(llm, lambda out: (
        len(sched.running), len({c.request_id for c in out.chunks} | {s.request_id
                                                                     for s in out.samples})))
    for i in range(10):
        llm.engine.add_request(f"r{i}", prompt(i, 8 + i), SamplingParams(
            temperature=0, max_tokens=3 + i, ignore_eos=True))
    run_until_done(llm)
    assert max(running for running, _ in counts) == max(batch for _, batch in counts) == 3
    assert llm.stats().generation_tokens == sum(3 + i for i in range(10))


@pytest.mark.parametrize("common", [32, 30])
def test_prefix_caching_computes_only_new_blocks(tiny_path, common: int) -> None:
    base = prompt(7, 40)
    second = base[:common] + prompt(8, 12)
    cached = common // 4 * 4  # whole blocks only: 8 of them, or 7
    llm = LLM(str(tiny_path), num_kv_blocks=64, block_size=4)
    first = llm.generate([base], GREEDY)[0].outputs[0]
    out = llm.generate([second], GREEDY)[0].outputs[0]
    stats = llm.stats()
    assert (first.num_cached_tokens, out.num_cached_tokens) == (0, cached)
    assert (stats.prompt_tokens_computed, stats.prompt_tokens_cached) == (
        40 + len(second) - cached, cached)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (
        40 + len(second), cached)
    # `solo_tokens` runs with prefix caching disabled.
    assert first.token_ids == solo_tokens(tiny_path, base, GREEDY, block_size=16)
    assert out.token_ids == solo_tokens(tiny_path, second, GREEDY, block_size=16)


def test_prefix_hit_within_one_step(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=64, block_size=4)
    base = prompt(9, 40)
    second = base[:36] + prompt(10, 5)
    llm.engine.add_request("first", base, GREEDY)
    llm.engine.add_request("second", second, GREEDY)
    first_step = {d.request_id: d for d in llm.engine.step().deltas}
    reqs = llm.engine.requests
    assert reqs["second"].block_ids[:9] == reqs["first"].block_ids[:9]
    seen = run_until_done(llm)
    assert seen["second"][-1].num_cached_tokens == 36
    assert llm.stats().prompt_tokens_computed == 40 + 5
    for rid, ids in (("first", base), ("second", second)):
        tokens = first_step[rid].token_ids + tokens_of(seen[rid])
        assert tokens == solo_tokens(tiny_path, ids, GREEDY, block_size=16), rid
