"""Scheduler: exact block ids and chunks on a pure scheduler, then the engine with a tiny model
(preemption, chunked prefill, prefix caching, aborts, caps) checked token for token against
each request run alone, and the pool checked for leaks afterwards.

Pure tests drive `Scheduler.schedule()` by hand and play the engine's part by appending one
output token to every chunk that samples:

    block_size 4, prompt of 10 tokens:   [0 1 2 3][4 5 6 7][8 9 . .]   blocks 0, 1, 2
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_model import make_tiny_model

from plait import LLM, SamplingParams
from plait.engine.block_pool import BlockPool
from plait.engine.request import Request, RequestStatus
from plait.engine.scheduler import RequestRejected, Scheduler, SchedulerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# --- pure scheduler ------------------------------------------------------------------------

def make_scheduler(num_blocks: int, *, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int | None = None,
                   caching: bool = True) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, caching), block_size, max_num_seqs,
                     max_num_batched_tokens, max_model_len or num_blocks * block_size,
                     max_shared_logits=0)


def add(sched: Scheduler, request_id: str, token_ids: list[int],
        params: SamplingParams = GREEDY) -> Request:
    req = Request(request_id, list(token_ids), params)
    sched.add_request(req)
    return req


def schedule(sched: Scheduler, token_id: int = 7) -> SchedulerOutput:
    """One step: schedule, then append `token_id` to every request that samples."""
    out = sched.schedule()
    for chunk in out.chunks:
        if chunk.sample:
            chunk.request.output_token_ids.append(token_id)
    return out


def chunks_of(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks]


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks


def test_prefill_then_decode_allocates_exact_blocks() -> None:
    sched = make_scheduler(8)
    req = add(sched, "a", list(range(100, 110)))
    out = schedule(sched)
    assert chunks_of(out) == [("a", 0, 10, True)]
    assert req.block_ids == out.new_block_ids == [0, 1, 2]
    assert [sched.pool.lookup(h) for h in req.block_hashes] == [0, 1]  # full blocks only
    assert chunks_of(schedule(sched)) == [("a", 10, 1, True)]  # position 10: block 2
    out = schedule(sched)  # position 11 fills block 2, which becomes findable
    assert (chunks_of(out), out.new_block_ids) == ([("a", 11, 1, True)], [])
    assert sched.pool.lookup(req.block_hashes[2]) == 2
    out = schedule(sched)  # position 12 opens block 3
    assert (chunks_of(out), out.new_block_ids, req.block_ids) == (
        [("a", 12, 1, True)], [3], [0, 1, 2, 3])
    sched.finish(req)
    assert req.status == RequestStatus.FINISHED
    assert_all_free(sched.pool)


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = make_scheduler(8, max_num_batched_tokens=8)
    a = add(sched, "a", list(range(100, 110)))
    b = add(sched, "b", list(range(200, 206)))
    out = schedule(sched)
    assert chunks_of(out) == [("a", 0, 8, False)]
    assert (a.block_ids, b.block_ids, b.status) == ([0, 1], [], RequestStatus.WAITING)
    out = schedule(sched)
    assert chunks_of(out) == [("a", 8, 2, True), ("b", 0, 6, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4])
    assert chunks_of(schedule(sched)) == [("a", 10, 1, True), ("b", 6, 1, True)]
    assert sched.stats.prompt_tokens_computed == 16


def test_preemption_takes_the_newest_request_and_recompute_hits_its_head() -> None:
    sched = make_scheduler(4)
    a = add(sched, "a", list(range(100, 107)))
    b = add(sched, "b", list(range(200, 207)))
    schedule(sched)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    schedule(sched)  # position 7 fills each request's second block
    out = schedule(sched)  # a needs a 5th block for position 8: b is preempted
    assert out.preempted == [b]
    assert chunks_of(out) == [("a", 8, 1, True)]
    assert a.block_ids == [0, 1, 3]  # b's blocks were freed tail first: its tail went first
    assert (b.status, b.block_ids, b.num_computed_tokens) == (RequestStatus.WAITING, [], 0)
    assert list(sched.waiting) == [b]
    assert (b.num_preemptions, sched.stats.num_preemptions) == (1, 1)
    sched.finish(a)
    out = schedule(sched)
    # b's head block (2) is still cached; its second block was reused by a, so recompute
    # starts at token 4 and its 9 tokens (7 prompt + 2 output) end in a new block.
    assert chunks_of(out) == [("b", 4, 5, True)]
    assert b.block_ids == [2, 3, 1]
    assert sched.stats.prompt_tokens_computed == 7 + 7 + 3
    assert b.output_token_ids == [7, 7, 7]
    sched.finish(b)
    assert_all_free(sched.pool)


@pytest.mark.parametrize("same_step", [False, True])
def test_prefix_hit_shares_full_blocks(same_step: bool) -> None:
    sched = make_scheduler(8)
    a = add(sched, "a", list(range(100, 109)))
    if not same_step:
        schedule(sched)
        sched.finish(a)  # free queue: [3 4 5 6 7 2 1 0]
    b = add(sched, "b", [*range(100, 108), 50, 51, 52])
    out = schedule(sched)
    expected = [("a", 0, 9, True)] if same_step else []
    assert chunks_of(out) == [*expected, ("b", 8, 3, True)]
    assert b.block_ids == [0, 1, 3]
    assert b.num_cached_tokens == 8
    s = sched.stats
    assert (s.prompt_tokens_computed, s.prompt_tokens_cached) == (9 + 3, 8)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (9 + 11, 8)


def test_prefix_hit_always_leaves_a_token_to_compute() -> None:
    sched = make_scheduler(8)
    a = add(sched, "a", list(range(100, 111)))
    schedule(sched)
    assert a.block_ids == [0, 1, 2]
    c = add(sched, "c", list(range(100, 108)))  # exactly a's first two blocks
    out = schedule(sched)
    assert chunks_of(out) == [("a", 11, 1, True), ("c", 4, 4, True)]
    assert c.block_ids == [0, 3]  # block 1's content is recomputed into block 3
    assert [sched.pool.ref_count(i) for i in range(4)] == [2, 1, 1, 1]
    assert c.num_cached_tokens == 4


def test_disabled_caching_never_shares() -> None:
    sched = make_scheduler(8, caching=False)
    a = add(sched, "a", list(range(100, 109)))
    b = add(sched, "b", list(range(100, 109)))  # same prompt: no sharing without caching
    out = schedule(sched)
    assert chunks_of(out) == [("a", 0, 9, True), ("b", 0, 9, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5])
    assert sched.stats.prompt_tokens_cached == 0
    sched.finish(a)
    sched.finish(b)
    assert_all_free(sched.pool)


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(16, max_num_seqs=2)
    reqs = [add(sched, f"r{i}", list(range(100 * i, 100 * i + 5))) for i in range(1, 4)]
    out = schedule(sched)
    assert [c.request.request_id for c in out.chunks] == ["r1", "r2"]
    assert list(sched.waiting) == [reqs[2]]
    sched.finish(reqs[0])
    out = schedule(sched)
    assert chunks_of(out) == [("r2", 5, 1, True), ("r3", 0, 5, True)]


def test_finish_of_waiting_and_running_requests_frees_everything() -> None:
    sched = make_scheduler(8, max_num_seqs=1)
    a = add(sched, "a", list(range(100, 110)))
    b = add(sched, "b", list(range(200, 210)))
    schedule(sched)
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    sched.finish(b)
    sched.finish(a)
    assert (sched.running, list(sched.waiting), sched.num_unfinished) == ([], [], 0)
    assert_all_free(sched.pool)
    assert sched.schedule().is_empty


def test_request_outgrowing_the_pool_is_reported_unservable() -> None:
    sched = make_scheduler(4, max_model_len=100)
    req = add(sched, "a", list(range(100, 114)), SamplingParams(max_tokens=10))
    for _ in range(3):  # prompt, then positions 14 and 15 fill the pool's 4 blocks
        assert not schedule(sched).unservable
    out = schedule(sched)  # position 16 needs a 5th block
    assert (out.unservable, out.chunks) == ([req], [])
    assert req.block_ids == []
    sched.finish(req)
    assert_all_free(sched.pool)


def test_add_request_rejects_what_can_never_fit() -> None:
    sched = make_scheduler(4, max_model_len=100)  # the pool holds 16 tokens
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        add(sched, "empty", [])
    with pytest.raises(RequestRejected, match=r"16 tokens, more than the KV cache can hold \(16\)"):
        add(sched, "pool", list(range(16)))
    short = make_scheduler(16, max_model_len=12)
    with pytest.raises(RequestRejected, match="12 tokens; with one generated token that exceeds "
                       "the maximum context length of 12 tokens"):
        add(short, "long", list(range(12)))
    assert add(short, "fits", list(range(11)), SamplingParams(max_tokens=5)).max_tokens == 1
    assert add(short, "clamp", list(range(4)), SamplingParams(max_tokens=None)).max_tokens == 8
    assert add(short, "asked", list(range(4)), SamplingParams(max_tokens=3)).max_tokens == 3
    assert [r.request_id for r in short.waiting] == ["fits", "clamp", "asked"]
    assert not sched.waiting


# --- engine with a tiny model --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, default_model):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_sched"), default_model.path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: thread hand-offs cost more than they save, worse on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(length)]


_ALONE: dict[tuple, list[int]] = {}
_ALONE_LLM: dict[str, LLM] = {}


def alone(path, token_ids: list[int], params: SamplingParams) -> list[int]:
    """The tokens of this request run by itself (no batch, no cache, no preemption)."""
    key = (tuple(token_ids), repr(params))
    if key not in _ALONE:
        if "llm" not in _ALONE_LLM:
            _ALONE_LLM["llm"] = LLM(str(path), num_kv_blocks=64, block_size=16,
                                    enable_prefix_caching=False)
        out = _ALONE_LLM["llm"].generate([token_ids], params)[0].outputs[0]
        _ALONE[key] = out.token_ids
    return _ALONE[key]


def run_until_done(llm: LLM) -> dict[str, list]:
    """Step the engine to the end; request id -> its deltas."""
    seen: dict[str, list] = {}
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
    return seen


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def record_schedules(llm: LLM, measure) -> list:
    """Record `measure(out)` for every `schedule()` the engine makes from now on."""
    sched = llm.engine.scheduler
    original, recorded = sched.schedule, []

    def recording_schedule() -> SchedulerOutput:
        out = original()
        recorded.append(measure(out))
        return out

    sched.schedule = recording_schedule
    return recorded


def assert_only_kept_prompts_pinned(llm: LLM) -> None:
    """Every block still used is pinned by a kept shared prompt; clearing those frees all."""
    pool, share = llm.engine.pool, llm.engine.scheduler.share
    pins: dict[int, int] = {}
    for block_id in (b for entry in share.ready.values() for b in entry.block_ids):
        pins[block_id] = pins.get(block_id, 0) + 1
    assert {i: pool.ref_count(i) for i in range(pool.num_blocks) if pool.ref_count(i)} == pins
    assert pool.num_free_blocks == pool.num_blocks - len(pins)
    assert llm.stats()["kv_blocks_used"] == len(pins)
    assert share.in_flight == {}
    share.clear()
    assert_all_free(pool)


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
    assert llm.stats()["num_preemptions"] > 0
    for rid, ids, params in jobs:
        assert tokens_of(seen[rid]) == alone(tiny_path, ids, params), rid
        assert seen[rid][-1].finish_reason == "length"
    assert llm.stats()["generation_tokens"] == sum(p.max_tokens for _, _, p in jobs)
    assert_only_kept_prompts_pinned(llm)


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
              "kept": len(sched.share.ready),
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
    assert llm.engine.step() == []
    assert_only_kept_prompts_pinned(llm)
    # The engine still serves correctly after the mass abort.
    rid, ids, params = jobs[5]
    llm.engine.add_request("after", ids, params)
    assert tokens_of(run_until_done(llm)["after"]) == alone(tiny_path, ids, params)


def test_abort_of_waiting_and_running_request_frees_everything(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=32, block_size=4, max_num_seqs=1)
    llm.engine.add_request("run", prompt(1, 30), GREEDY)
    llm.engine.add_request("wait", prompt(2, 30), GREEDY)
    llm.engine.step()
    llm.engine.step()
    stats = llm.stats()
    assert (stats["num_running"], stats["num_waiting"]) == (1, 1)
    assert llm.engine.abort("wait").finish_reason == "abort"
    # run's 8 prompt blocks are pinned by its kept prompt too; its first decode token went
    # into a private copy of the partial last block: 8 + 1 blocks in use.
    assert llm.stats()["kv_blocks_used"] == 9
    assert llm.engine.abort("run").finish_reason == "abort"
    assert llm.engine.step() == []
    assert llm.stats()["shared_prompts_kept"] == 1
    assert_only_kept_prompts_pinned(llm)


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
    assert llm.stats()["prompt_tokens_computed"] == 50 + 75 + 100
    for rid, ids, params in jobs:
        assert tokens_of(seen[rid]) == alone(tiny_path, ids, params), rid
    if caching:
        assert_only_kept_prompts_pinned(llm)
    else:
        assert llm.stats()["shared_prompts_kept"] == 0
        assert_all_free(llm.engine.pool)


def test_engine_rejects_requests_that_can_never_fit(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=8, block_size=4)  # the pool holds 32 tokens
    assert llm.engine.info.max_model_len == 32
    with pytest.raises(RequestRejected, match="32 tokens; with one generated token that exceeds "
                       "the maximum context length of 32 tokens"):
        llm.engine.add_request("big", prompt(1, 32), GREEDY)
    capped = LLM(str(tiny_path), num_kv_blocks=64, block_size=4, max_model_len=20)
    with pytest.raises(RequestRejected, match="maximum context length of 20 tokens"):
        capped.engine.add_request("big", prompt(1, 20), GREEDY)
    assert not llm.engine.has_unfinished() and not capped.engine.has_unfinished()
    # One token short of the limit still runs, and stops at the context length.
    capped.engine.add_request("fits", prompt(1, 19), GREEDY)
    (delta,) = run_until_done(capped)["fits"]
    assert (len(delta.token_ids), delta.finish_reason) == (1, "length")


def test_max_num_seqs_is_never_exceeded(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=64, block_size=4, max_num_seqs=3)
    sched = llm.engine.scheduler
    counts = record_schedules(llm, lambda out: (
        len(sched.running), len({id(c.request) for c in out.chunks} | {id(s.request)
                                                                       for s in out.shared})))
    for i in range(10):
        llm.engine.add_request(f"r{i}", prompt(i, 8 + i), SamplingParams(
            temperature=0, max_tokens=3 + i, ignore_eos=True))
    run_until_done(llm)
    assert max(running for running, _ in counts) == max(batch for _, batch in counts) == 3
    assert llm.stats()["generation_tokens"] == sum(3 + i for i in range(10))


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
    assert (stats["prompt_tokens_computed"], stats["prompt_tokens_cached"]) == (
        40 + len(second) - cached, cached)
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (
        40 + len(second), cached)
    # `alone` runs with prefix caching disabled.
    assert first.token_ids == alone(tiny_path, base, GREEDY)
    assert out.token_ids == alone(tiny_path, second, GREEDY)


def test_prefix_hit_within_one_step(tiny_path) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=64, block_size=4)
    base = prompt(9, 40)
    second = base[:36] + prompt(10, 5)
    llm.engine.add_request("first", base, GREEDY)
    llm.engine.add_request("second", second, GREEDY)
    first_step = {d.request_id: d for d in llm.engine.step()}
    reqs = llm.engine.requests
    assert reqs["second"].block_ids[:9] == reqs["first"].block_ids[:9]
    seen = run_until_done(llm)
    assert seen["second"][-1].num_cached_tokens == 36
    assert llm.stats()["prompt_tokens_computed"] == 40 + 5
    for rid, ids in (("first", base), ("second", second)):
        tokens = first_step[rid].token_ids + tokens_of(seen[rid])
        assert tokens == alone(tiny_path, ids, GREEDY), rid
