"""The scheduler's side of speculative decoding, without a model: drafts become extra rows
of a decode chunk; `verified` rolls the request back to what was accepted, frees the
blocks past it, and registers a block by content only once all of its tokens are verified.

    block_size 4, prompt of 6 tokens:  [0 1 2 3][4 5 | 6 7][8 ...
"""

from __future__ import annotations

from test_scheduler_unit import add, chunks_of, make_scheduler, schedule

from plait.engine.request import Request
from plait.engine.sched_output import SchedulerOutput
from plait.engine.scheduler import Scheduler


def spec_step(sched: Scheduler, req: Request, draft: list[int], kept: list[int]
              ) -> SchedulerOutput:
    """One step with `draft` for `req`; the model keeps `kept` (accepted drafts then its
    own token), as the engine core applies it."""
    out = sched.schedule({req.request_id: draft})
    sched.update_from_output(out)
    (chunk,) = [c for c in out.chunks if c.request_id == req.request_id]
    req.output_token_ids.extend(kept)
    sched.verified(req, chunk.start, len(kept))
    return out


def test_draft_rows_rollback_and_registration() -> None:
    sched = make_scheduler(8)
    req = add(sched, "a", [100, 101, 102, 103, 104, 105])
    schedule(sched)  # prefill; samples token 7 (position 6)
    assert req.block_ids == [0, 1]
    # position 6 (the sampled 7) + drafts at 7, 8, 9: block 2 is allocated for them
    out = spec_step(sched, req, [20, 21, 22], kept=[20, 30])  # 20 accepted, 21 rejected
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.sample, chunk.draft_token_ids) == (
        6, 4, True, (20, 21, 22))
    assert out.block_tables == (("a", (0, 1, 2)),)
    # kept: positions 6 (7) and 7 (20) computed; 30 is the next token to compute
    assert (req.num_computed_tokens, req.num_tokens) == (8, 9)
    assert req.block_ids == [0, 1]  # block 2 held only rejected drafts: freed
    assert sched.pool.ref_count(2) == 0 and not sched.pool.is_hashed(2)
    # block 1 ([104 105 7 20]) is full of verified tokens now: findable by content
    assert len(req.block_hashes) == 2
    assert sched.pool.lookup(req.block_hashes[1]) == 1
    # the next step starts at the model's token, in a new block; the freed one returns
    out = spec_step(sched, req, [31, 32], kept=[31, 32, 33])  # all accepted + bonus
    assert chunks_of(out) == [("a", 8, 3, True)]
    assert out.chunks[0].draft_token_ids == (31, 32)
    assert (req.num_computed_tokens, req.num_tokens) == (11, 12)
    assert len(req.block_ids) == 3
    # block 2 holds 30 31 32 and the next token's slot: not full, not registered
    assert not sched.pool.is_hashed(req.block_ids[2])
    sched.finish(req)
    assert sched.pool.num_free_blocks == 8


def test_a_block_filled_by_drafts_is_registered_only_when_they_are_accepted() -> None:
    sched = make_scheduler(8)
    req = add(sched, "a", [100, 101, 102, 103, 104])
    schedule(sched)  # position 5 is the sampled 7
    # drafts at 6, 7 fill block 1 ([104 7 d d]) in the step, unverified: not registered
    out = sched.schedule({"a": [40, 41]})
    sched.update_from_output(out)
    assert not sched.pool.is_hashed(1)
    req.output_token_ids.extend([42])  # both rejected
    sched.verified(req, 5, 1)
    assert not sched.pool.is_hashed(1)
    assert (req.num_computed_tokens, req.block_ids) == (6, [0, 1])
    # accepted this time: registered with the verified tokens
    spec_step(sched, req, [43], kept=[43, 44])  # positions 6 (42) and 7 (43) computed
    assert req.token_ids(4, 8) == [104, 7, 42, 43]
    assert sched.pool.lookup(req.block_hashes[1]) == 1


def test_drafts_respect_the_token_budget() -> None:
    sched = make_scheduler(3, max_num_batched_tokens=3)
    a = add(sched, "a", [100, 101, 102])
    schedule(sched)  # a: block 0, position 3 is the sampled 7
    # budget 3: the draft of 5 is cut to 2 (1 + 2 rows)
    out = sched.schedule({"a": [1, 2, 3, 4, 5]})
    assert out.chunks[0].draft_token_ids == (1, 2)
    sched.update_from_output(out)
    a.output_token_ids.extend([1, 2, 9])
    sched.verified(a, 3, 3)
    assert (a.num_computed_tokens, a.block_ids) == (6, [0, 1])


def test_a_draft_that_needs_a_block_the_pool_lacks_is_dropped_not_preempting() -> None:
    sched = make_scheduler(3, max_num_batched_tokens=16)
    a = add(sched, "a", [100, 101, 102])
    b = add(sched, "b", [200, 201, 202, 203, 204, 205, 206])
    schedule(sched)  # a: block 0 (position 3 next), b: blocks 1, 2 (position 7 next)
    assert (a.block_ids, b.block_ids, sched.pool.num_free_blocks) == ([0], [1, 2], 0)
    out = sched.schedule({"a": [5, 6, 7], "b": [8]})
    # each draft would open a 4th block (a: positions 4-6, b: position 8): both dropped,
    # and neither request is preempted for them
    assert chunks_of(out) == [("a", 3, 1, True), ("b", 7, 1, True)]
    assert [c.draft_token_ids for c in out.chunks] == [(), ()]
    assert out.preempted_ids == ()
