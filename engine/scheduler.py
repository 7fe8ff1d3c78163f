"""Continuous batching over single sequences, with prefix caching and prompt sharing.

Each `schedule()` call:
  1. gives running requests their next tokens (a decode token, or the next prefill chunk),
     preempting the newest running request by recompute when the pool runs out;
  2. admits waiting requests under `max_num_batched_tokens` and `max_num_seqs`, reusing
     cached full blocks and sharing identical in-flight prompts (prompt_share.py).

`num_computed_tokens` advances when a chunk is scheduled, so the step's output never has to
be reconciled with the schedule. Never imports torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from plait.engine.block_pool import BlockPool, hash_block
from plait.engine.prompt_share import PromptShareTable, ShareEntry, prompt_key
from plait.engine.request import Request, RequestStatus


class RequestRejected(ValueError):
    """The request can never be served (too long for the model or for the KV pool)."""


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `request` are computed this step."""

    request: Request
    start: int
    num_tokens: int
    sample: bool  # the chunk ends at the request's last token: sample the next one


@dataclass(slots=True)
class SharedSample:
    """`request` samples from logits it did not compute: the row of `source` (computed in
    this step) or the row kept by a ready `entry`."""

    request: Request
    source: Request | None
    entry: ShareEntry | None


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    shared: list[SharedSample] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before forward
    new_block_ids: list[int] = field(default_factory=list)
    # Blocks whose hash was registered this step (their K/V is written by this step).
    registered_block_ids: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that can never progress (need more blocks than the pool has): finish them.
    unservable: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.shared and not self.unservable


@dataclass(slots=True)
class SchedulerStats:
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found (blocks or shared prompt)
    num_preemptions: int = 0


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def check_prompt_fits(num_prompt: int, max_model_len: int, num_blocks: int,
                      block_size: int) -> None:
    """Raise `RequestRejected` unless the prompt plus one generated token can ever fit."""
    if num_prompt == 0:
        raise RequestRejected("the prompt is empty")
    if num_prompt + 1 > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"prompt has {num_prompt} tokens; with one generated token that exceeds the "
            f"maximum context length of {max_model_len} tokens.")
    if cdiv(num_prompt + 1, block_size) > num_blocks:
        raise RequestRejected(f"the prompt has {num_prompt} tokens, more than the KV cache "
                              f"can hold ({num_blocks * block_size})")


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, max_shared_logits: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.share = PromptShareTable(pool, max_shared_logits)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.step_idx = 0

    # ---------------------------------------------------------------- requests in / out
    def add_request(self, req: Request) -> None:
        """Queue `req`, or raise `RequestRejected` if it can never fit."""
        num_prompt = req.num_prompt_tokens
        check_prompt_fits(num_prompt, self.max_model_len, self.pool.num_blocks, self.block_size)
        room = self.max_model_len - num_prompt
        wanted = req.params.max_tokens
        req.max_tokens = room if wanted is None else min(wanted, room)
        if self.pool.enable_caching and not req.needs_prompt_logprobs:
            req.share_key = prompt_key(req.prompt_token_ids, req.extra_key)
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Remove `req` (finished or aborted) wherever it is and free all it holds."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            self.share.unpark(req)
        self._release(req)
        req.status = RequestStatus.FINISHED

    def publish_prompt_logits(self, req: Request, logits: object) -> None:
        """Called after `req` (an owner) sampled from its last prompt position."""
        entry = req.share_entry
        if entry is None or entry.owner is not req:
            return
        num_prompt_blocks = cdiv(req.num_prompt_tokens, self.block_size)
        followers = self.share.publish(entry, logits, req.block_ids[:num_prompt_blocks])
        self.waiting.extendleft(reversed(followers))

    @property
    def num_unfinished(self) -> int:
        parked = sum(len(e.followers) for e in self.share.in_flight.values())
        return len(self.waiting) + len(self.running) + parked

    # ---------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        self.step_idx += 1
        out = SchedulerOutput()
        scheduled: set[int] = set()
        budget = self._schedule_running(out, scheduled)
        self._schedule_waiting(out, scheduled, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[int]) -> int:
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if id(req) in scheduled or req.status != RequestStatus.RUNNING or budget <= 0:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while not self._allocate(req, num_new, out):
                if self.share.evict_one():
                    continue
                victim = next((r for r in reversed(self.running)
                               if id(r) not in scheduled and r is not req), None)
                self._preempt(victim or req, out)
                if victim is None:
                    break
            if req.status == RequestStatus.RUNNING:
                self._add_chunk(req, num_new, out, scheduled)
                budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.share_key is not None and not req.output_token_ids:
                entry = self.share.lookup(req.share_key)
                if entry is not None and entry.ready:
                    self.waiting.popleft()
                    self._admit_shared(req, entry.block_ids, None, entry, out, scheduled)
                    continue
                if entry is not None and entry.owner is not req:
                    self.waiting.popleft()
                    if entry.final_step == self.step_idx and entry.owner is not None:
                        # the owner computes the prompt's end in this very step: join it
                        owner = entry.owner
                        blocks = owner.block_ids[: cdiv(owner.num_prompt_tokens, self.block_size)]
                        self._admit_shared(req, blocks, owner, None, out, scheduled)
                    else:
                        self.share.park(entry, req)
                    continue
                if entry is None:
                    self.share.start(req.share_key, req)
            if budget <= 0:
                break
            num_new = self._admit(req, budget, out)
            if num_new is None:
                if not self.running and not out.chunks:
                    self.waiting.popleft()  # needs more blocks than the pool will ever have
                    out.unservable.append(req)
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(req, num_new, out, scheduled)
            budget -= num_new

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Take cached prefix blocks and allocate for the first chunk; None if no room."""
        hits = self._match_prefix(req)
        num_hit = len(hits) * self.block_size
        num_new = min(req.num_tokens - num_hit, budget)
        num_needed = cdiv(num_hit + num_new, self.block_size) - len(hits)
        reviving = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        while num_needed > self.pool.num_free_blocks - reviving:
            if not self.share.evict_one():
                return None
            reviving = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        self.pool.touch(hits)
        req.block_ids = hits
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens is None:
            req.num_cached_tokens = min(num_hit, req.num_prompt_tokens)
            self.stats.prefix_cache_queries += req.num_prompt_tokens
            self.stats.prefix_cache_hits += req.num_cached_tokens
            self.stats.prompt_tokens_cached += req.num_cached_tokens
        allocated = self._allocate(req, num_new, out)
        assert allocated, "room was checked above"
        return num_new

    def _match_prefix(self, req: Request) -> list[int]:
        """Cached blocks for the request's leading full blocks. At least one token is always
        left to compute, since its logits are needed."""
        if not self.pool.enable_caching or req.needs_prompt_logprobs:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits: list[int] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _admit_shared(self, req: Request, block_ids: list[int], source: Request | None,
                      entry: ShareEntry | None, out: SchedulerOutput, scheduled: set[int]) -> None:
        """Admit `req` on a prompt that is computed (or being computed in this step)."""
        self.pool.touch(block_ids)
        req.block_ids = list(block_ids)
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.add(id(req))
        self.stats.prefix_cache_queries += req.num_prompt_tokens
        self.stats.prefix_cache_hits += req.num_prompt_tokens
        self.stats.prompt_tokens_cached += req.num_prompt_tokens
        out.shared.append(SharedSample(req, source, entry))

    def _add_chunk(self, req: Request, num_new: int, out: SchedulerOutput,
                   scheduled: set[int]) -> None:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        sample = req.num_computed_tokens == req.num_tokens
        out.chunks.append(ScheduledChunk(req, start, num_new, sample))
        scheduled.add(id(req))
        if start < req.num_prompt_tokens:
            self.stats.prompt_tokens_computed += min(req.num_computed_tokens,
                                                     req.num_prompt_tokens) - start
        entry = req.share_entry
        if sample and entry is not None and entry.owner is req and not req.output_token_ids:
            # The prompt's last token is computed now: its parked followers join this step.
            entry.final_step = self.step_idx
            num_prompt_blocks = cdiv(req.num_prompt_tokens, self.block_size)
            while entry.followers and len(self.running) < self.max_num_seqs:
                follower = entry.followers.pop(0)
                follower.share_entry = None
                self._admit_shared(follower, req.block_ids[:num_prompt_blocks], req, None,
                                   out, scheduled)

    # ---------------------------------------------------------------- blocks
    def _allocate(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Make room for tokens [computed, computed + num_new); False if the pool is short.

        A write into a last block that others still reference first copies it."""
        start = req.num_computed_tokens
        end = start + num_new
        num_needed = cdiv(end, self.block_size) - len(req.block_ids)
        last = req.block_ids[-1] if req.block_ids else None
        copy_on_write = (start % self.block_size != 0 and last is not None
                         and self.pool.ref_count(last) > 1)
        if num_needed + copy_on_write > self.pool.num_free_blocks:
            return False
        if copy_on_write:
            assert last is not None
            (private,) = self.pool.allocate(1)
            out.block_copies.append((last, private))
            out.new_block_ids.append(private)
            self.pool.free([last])
            req.block_ids[-1] = private
        if num_needed > 0:
            new_ids = self.pool.allocate(num_needed)
            req.block_ids.extend(new_ids)
            out.new_block_ids.extend(new_ids)
        # Blocks that become full in this step are registered now, so a request scheduled
        # later in this step (or later) can share them.
        first_full, last_full = start // self.block_size, end // self.block_size
        if self.pool.enable_caching and last_full > first_full:
            self._extend_hashes(req, last_full)
            for idx in range(first_full, last_full):
                self.pool.register(req.block_ids[idx], req.block_hashes[idx])
                out.registered_block_ids.append(req.block_ids[idx])
        return True

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        bs = self.block_size
        for idx in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[idx - 1] if idx else None
            tokens = req.token_ids(idx * bs, (idx + 1) * bs)
            req.block_hashes.append(hash_block(parent, tokens, req.extra_key))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute later: free the blocks (they stay cached), back to the queue front."""
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        entry = req.share_entry
        if entry is not None and entry.owner is req:
            followers = self.share.drop_owner(entry)
            self.waiting.extendleft(reversed(followers))

    def fail_step(self, out: SchedulerOutput) -> None:
        """The step's forward pass failed: blocks it was to fill hold no valid K/V."""
        self.pool.forget(out.new_block_ids)
        self.pool.forget(out.registered_block_ids)
