"""Scheduler without a model: exact block ids and chunks on a pure scheduler. The engine with a
tiny model is checked in test_scheduler_engine.py.

These tests drive `Scheduler.schedule()` by hand and play the engine's part by appending one
output token to every chunk that samples:

    block_size 4, prompt of 10 tokens:   [0 1 2 3][4 5 6 7][8 9 . .]   blocks 0, 1, 2
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers.engine import GREEDY, assert_all_free

from plait import SamplingParams
from plait.engine.block_pool import BlockPool
from plait.engine.request import Request, RequestStatus
from plait.engine.sched_output import SampleRow, SchedulerOutput
from plait.engine.scheduler import Scheduler
from plait.engine.validation import RequestRejected, check_prompt_fits


def make_scheduler(num_blocks: int, *, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int | None = None,
                   caching: bool = True, max_shared_logits: int = 0,
                   max_prefill_tokens_with_decodes: int = 0) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, caching), block_size, max_num_seqs,
                     max_num_batched_tokens, max_model_len or num_blocks * block_size,
                     max_shared_logits=max_shared_logits,
                     max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes)


def add(sched: Scheduler, request_id: str, token_ids: list[int],
        params: SamplingParams = GREEDY) -> Request:
    """Validate (as every path into the engine does), then queue."""
    check_prompt_fits(len(token_ids), sched.max_model_len, sched.pool.num_blocks,
                      sched.block_size)
    req = Request(request_id, list(token_ids), params)
    sched.add_request(req)
    REQUESTS[request_id] = req
    return req


REQUESTS: dict[str, Request] = {}  # request id -> request, for the engine's part below


def schedule(sched: Scheduler, token_id: int = 7) -> SchedulerOutput:
    """One step: schedule, then append `token_id` to every request that samples."""
    out = sched.schedule()
    for row in out.samples:
        REQUESTS[row.request_id].output_token_ids.append(token_id)
    sched.update_from_output(out)
    return out


def chunks_of(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks]


def test_prefill_then_decode_allocates_exact_blocks() -> None:
    sched = make_scheduler(8)
    req = add(sched, "a", list(range(100, 110)))
    out = schedule(sched)
    assert chunks_of(out) == [("a", 0, 10, True)]
    assert req.block_ids == [0, 1, 2]
    assert out.block_tables == (("a", (0, 1, 2)),)
    assert [sched.pool.lookup(h) for h in req.block_hashes] == [0, 1]  # full blocks only
    assert chunks_of(schedule(sched)) == [("a", 10, 1, True)]  # position 10: block 2
    out = schedule(sched)  # position 11 fills block 2, which becomes findable
    assert (chunks_of(out), out.block_tables) == ([("a", 11, 1, True)], ())
    assert sched.pool.lookup(req.block_hashes[2]) == 2
    out = schedule(sched)  # position 12 opens block 3
    assert (chunks_of(out), out.block_tables, req.block_ids) == (
        [("a", 12, 1, True)], (("a", (0, 1, 2, 3)),), [0, 1, 2, 3])
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
    assert out.preempted_ids == ("b",)
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
    assert [c.request_id for c in out.chunks] == ["r1", "r2"]
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
    assert not sched.schedule().has_work


def test_request_outgrowing_the_pool_is_reported_unservable() -> None:
    sched = make_scheduler(4, max_model_len=100)
    req = add(sched, "a", list(range(100, 114)), SamplingParams(max_tokens=10))
    for _ in range(3):  # prompt, then positions 14 and 15 fill the pool's 4 blocks
        assert not schedule(sched).unservable_ids
    out = schedule(sched)  # position 16 needs a 5th block
    assert (out.unservable_ids, out.chunks) == (("a",), ())
    assert req.block_ids == []
    sched.finish(req)
    assert_all_free(sched.pool)


def test_validation_rejects_what_can_never_fit_and_add_request_clamps() -> None:
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


# --- the step boundary and kept prompts ----------------------------------------------------

PLAIN = (str, int, float, bool, bytes, type(None), SamplingParams)


def assert_plain(value, path: str = "out") -> None:
    """Only ids and plain data: no Request, share entry, tensor or other live object."""
    if dataclasses.is_dataclass(value) and not isinstance(value, SamplingParams):
        assert type(value).__dataclass_params__.frozen, path
        for f in dataclasses.fields(value):
            assert_plain(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            assert_plain(item, f"{path}[{i}]")
    else:
        assert isinstance(value, PLAIN), (path, type(value))


def test_scheduler_output_is_frozen_plain_data_described_once() -> None:
    sched = make_scheduler(16, max_shared_logits=2)
    add(sched, "a", list(range(100, 110)))
    add(sched, "b", list(range(100, 110)))  # parked on a, joins its final step
    out = schedule(sched)
    assert_plain(out)
    assert [n.request_id for n in out.new_requests] == ["a", "b"]
    assert out.new_requests[0].prompt_token_ids == tuple(range(100, 110))
    assert out.samples == (SampleRow("a", computed_by="a"), SampleRow("b", computed_by="a"))
    assert out.keep_logits == (("a", 0),)
    assert dict(out.block_tables) == {"a": (0, 1, 2), "b": (0, 1, 2)}
    out = schedule(sched)  # both write position 10 into the shared, hashed block 2: copies
    assert_plain(out)
    assert out.new_requests == ()
    assert out.block_copies == ((2, 3), (2, 4))
    assert dict(out.block_tables) == {"a": (0, 1, 3), "b": (0, 1, 4)}
    sched.finish(REQUESTS["a"])
    out = schedule(sched)
    assert out.finished_ids == ("a",) and out.block_tables == ()


def test_kept_prompt_holds_no_block_and_serves_a_repeat_without_compute() -> None:
    sched = make_scheduler(16, max_shared_logits=2)
    a = add(sched, "a", list(range(100, 110)))
    schedule(sched)
    schedule(sched)
    sched.finish(a)
    assert_all_free(sched.pool)  # kept, yet every block is free (cached)
    assert len(sched.share.kept) == 1
    b = add(sched, "b", list(range(100, 110)))
    out = schedule(sched)
    assert out.chunks == () and out.samples == (SampleRow("b", kept_slot=0),)
    assert b.block_ids == [0, 1, 2]  # revived from the free queue, not recomputed
    assert sched.stats.prompt_tokens_computed == 10
    sched.finish(b)
    assert_all_free(sched.pool)


def test_kept_prompt_whose_block_was_evicted_is_dropped() -> None:
    sched = make_scheduler(4, max_shared_logits=2)  # 16 token slots
    a = add(sched, "a", list(range(100, 110)))
    schedule(sched)
    sched.finish(a)
    other = add(sched, "other", list(range(500, 515)))  # takes all 4 blocks: evicts a's
    schedule(sched)
    sched.finish(other)
    b = add(sched, "b", list(range(100, 110)))
    out = schedule(sched)
    assert chunks_of(out) == [("b", 0, 10, True)]  # computed again
    assert sched.stats.prompt_tokens_computed == 10 + 15 + 10
    # a's stale entry was dropped; b's step kept the prompt again, now in b's blocks.
    entry, block_ids = sched.share.resolve_kept(b.share_key)
    assert block_ids == b.block_ids and entry.slot == 0  # a's freed slot, reused


def test_failed_step_keeps_no_prompt_and_frees_its_slot() -> None:
    sched = make_scheduler(8, max_shared_logits=1)
    a = add(sched, "a", list(range(100, 110)))
    out = sched.schedule()
    assert out.keep_logits == (("a", 0),)
    sched.fail_step(out)
    sched.finish(a)
    assert list(sched.share.kept) == [] and sched.share.reserve_slot() == 0
    assert [sched.pool.cached_block(h) for h in a.block_hashes] == [None, None]


@pytest.mark.parametrize("cap", [0, 8])
def test_prefill_tokens_are_capped_while_others_decode(cap: int) -> None:
    sched = make_scheduler(32, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=cap)
    add(sched, "a", list(range(100, 105)))
    add(sched, "b", list(range(200, 230)))
    # Nobody decodes yet: the whole budget goes to prefill.
    assert chunks_of(schedule(sched)) == [("a", 0, 5, True), ("b", 0, 30, True)]
    add(sched, "c", list(range(300, 330)))
    out = schedule(sched)  # a and b decode: c's prompt gets at most `cap` tokens per step
    first = 30 if cap == 0 else 8
    assert chunks_of(out) == [("a", 5, 1, True), ("b", 30, 1, True), ("c", 0, first, first == 30)]
    if cap:
        assert chunks_of(schedule(sched))[-1] == ("c", 8, 8, False)
