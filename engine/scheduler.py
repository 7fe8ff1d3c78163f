"""Continuous batching over single sequences, with prefix caching and prompt sharing.

Each `schedule()` call:
  1. gives running requests their next tokens (a decode token, or the next prefill chunk),
     preempting the newest running request by recompute when the pool runs out;
  2. admits waiting requests under `max_num_batched_tokens` and `max_num_seqs`, reusing
     cached full blocks and sharing identical in-flight prompts (prompt_share.py).
While any running request decodes, the step's prefill tokens (chunks of running prompts and
admissions together) are also capped by `max_prefill_tokens_with_decodes`, so a long prompt
arriving never stalls the running streams for a whole `max_num_batched_tokens` step.

`num_computed_tokens` advances when a chunk is scheduled, so the step's output never has to
be reconciled with the schedule; the one exception is a speculative decode (a draft given
to `schedule`), which `verified()` rolls back to what the model accepted. Never imports
torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plait.engine.block_pool import BlockPool, hash_block, hash_partial_block
from plait.engine.prompt_share import InFlightPrompt, PromptShareTable, prompt_key
from plait.engine.request import Request, RequestStatus
from plait.engine.sched_output import (
    NewRequest,
    SampleRow,
    ScheduledChunk,
    SchedulerOutput,
)
from plait.engine.validation import cdiv


@dataclass(slots=True)
class _StepBuilder:
    """The step being scheduled (mutable); frozen into a `SchedulerOutput` at the end."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    scheduled: dict[str, Request] = field(default_factory=dict)  # request id -> request
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    keep_logits: list[tuple[str, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    unservable: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _StepRecord:
    """What the last step changed in the pool and the share table, to undo if it fails."""

    new_block_ids: list[int] = field(default_factory=list)
    registered_block_ids: list[int] = field(default_factory=list)
    finishing_owners: list[Request] = field(default_factory=list)  # compute the prompt end


@dataclass(slots=True)
class SchedulerStats:
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found (blocks or shared prompt)
    num_preemptions: int = 0


class Scheduler:
    """Owns the waiting and running requests and every block-table decision.

    `schedule()` returns a frozen, id-keyed `SchedulerOutput`; after the runner executed it,
    the engine calls `update_from_output()` (success) or `fail_step()` (the forward pass
    raised). `finish()` removes a request wherever it is."""

    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, max_shared_logits: int,
                 max_prefill_tokens_with_decodes: int = 0) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.max_model_len = max_model_len
        self.share = PromptShareTable(pool, max_shared_logits)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.step_idx = 0
        self._finished_ids: list[str] = []  # known to the runner, finished since last step
        self._record = _StepRecord()

    # ---------------------------------------------------------------- requests in / out
    def add_request(self, req: Request) -> None:
        """Queue `req` (validated by `validate_request`: its prompt fits)."""
        room = self.max_model_len - req.num_prompt_tokens
        wanted = req.params.max_tokens
        req.max_tokens = room if wanted is None else min(wanted, room)
        if self.pool.enable_caching:
            req.share_key = prompt_key(req.prompt_token_ids, req.extra_key,
                                       req.params.prompt_logprobs)
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
        if req.known_to_runner:
            self._finished_ids.append(req.request_id)
            req.known_to_runner = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + self.share.num_parked

    # ---------------------------------------------------------------- scheduling
    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput:
        """The next step. `drafts` (speculative decoding): request id -> draft tokens for
        running requests that decode; each one scheduled as a decode gets its draft as
        extra rows, cut to the step's token budget, or dropped where the pool is short
        (never preempting another request for a draft)."""
        self.step_idx += 1
        self._record = _StepRecord()
        step = _StepBuilder()
        budget, prefill_budget = self._schedule_running(step, drafts or {})
        self._schedule_waiting(step, min(budget, prefill_budget))
        return self._freeze(step)

    def _prefill_budget(self) -> int:
        """Prefill tokens this step may compute: capped while a running request decodes."""
        cap = self.max_prefill_tokens_with_decodes
        if cap and any(r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1
                       for r in self.running):
            return min(cap, self.max_num_batched_tokens)
        return self.max_num_batched_tokens

    def _freeze(self, step: _StepBuilder) -> SchedulerOutput:
        """The step as plain data: new requests described once, changed tables only."""
        new_requests: list[NewRequest] = []
        tables: list[tuple[str, tuple[int, ...]]] = []
        for request_id, req in step.scheduled.items():
            if not req.known_to_runner:
                req.known_to_runner = True
                new_requests.append(NewRequest(request_id, tuple(req.prompt_token_ids),
                                               req.params))
            if req.blocks_changed:
                req.blocks_changed = False
                tables.append((request_id, tuple(req.block_ids)))
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            finished_ids=finished, new_requests=tuple(new_requests),
            block_tables=tuple(tables), block_copies=tuple(step.block_copies),
            chunks=tuple(step.chunks), samples=tuple(step.samples),
            keep_logits=tuple(step.keep_logits), preempted_ids=tuple(step.preempted),
            unservable_ids=tuple(step.unservable))

    def _schedule_running(self, step: _StepBuilder,
                          drafts: Mapping[str, Sequence[int]]) -> tuple[int, int]:
        """Decode tokens (with their drafts) and prefill chunks of running requests;
        returns what is left of the step's token budget and of its prefill budget."""
        budget = self.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        for req in list(self.running):
            if (req.request_id in step.scheduled or req.status != RequestStatus.RUNNING
                    or budget <= 0):
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            prefill = req.num_computed_tokens < req.num_prompt_tokens or num_new > 1
            if prefill:
                num_new = min(num_new, prefill_budget)
            if num_new <= 0:
                continue
            draft = () if prefill else tuple(drafts.get(req.request_id, ()))[:budget - 1]
            if draft and self._allocate(req, 1 + len(draft), step, len(draft)):
                self._add_chunk(req, 1 + len(draft), step, draft)
                budget -= 1 + len(draft)
                continue
            while not self._allocate(req, num_new, step):
                victim = next((r for r in reversed(self.running)
                               if r.request_id not in step.scheduled and r is not req), None)
                self._preempt(victim or req, step)
                if victim is None:
                    break
            if req.status == RequestStatus.RUNNING:
                self._add_chunk(req, num_new, step)
                budget -= num_new
                prefill_budget -= num_new if prefill else 0
        return budget, prefill_budget

    def _schedule_waiting(self, step: _StepBuilder, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.share_key is not None and not req.output_token_ids:
                kept = self.share.resolve_kept(req.share_key)
                if kept is not None:
                    entry, block_ids = kept
                    self.waiting.popleft()
                    self._admit_shared(req, block_ids, SampleRow(req.request_id,
                                                                 kept_slot=entry.slot), step)
                    continue
                in_flight = self.share.in_flight.get(req.share_key)
                if in_flight is not None and in_flight.owner is not req:
                    self.waiting.popleft()
                    owner = in_flight.owner
                    if in_flight.final_step == self.step_idx and owner is not None:
                        # the owner computes the prompt's end in this very step: join it
                        blocks = owner.block_ids[: cdiv(owner.num_prompt_tokens, self.block_size)]
                        self._admit_shared(req, blocks, SampleRow(
                            req.request_id, computed_by=owner.request_id), step)
                    else:
                        self.share.park(in_flight, req)
                    continue
                if in_flight is None:
                    self.share.start(req.share_key, req)
            if budget <= 0:
                break
            num_new = self._admit(req, budget, step)
            if num_new is None:
                if not self.running and not step.chunks:
                    self.waiting.popleft()  # needs more blocks than the pool will ever have
                    step.unservable.append(req.request_id)
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(req, num_new, step)
            budget -= num_new

    def _admit(self, req: Request, budget: int, step: _StepBuilder) -> int | None:
        """Take cached prefix blocks and allocate for the first chunk; None if no room."""
        hits = self._match_prefix(req)
        num_hit = len(hits) * self.block_size
        num_new = min(req.num_tokens - num_hit, budget)
        num_needed = cdiv(num_hit + num_new, self.block_size) - len(hits)
        reviving = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if num_needed > self.pool.num_free_blocks - reviving:
            return None
        self.pool.touch(hits)
        req.block_ids = hits
        req.blocks_changed = True
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens is None:
            req.num_cached_tokens = min(num_hit, req.num_prompt_tokens)
            self.stats.prefix_cache_queries += req.num_prompt_tokens
            self.stats.prefix_cache_hits += req.num_cached_tokens
            self.stats.prompt_tokens_cached += req.num_cached_tokens
        allocated = self._allocate(req, num_new, step)
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

    def _admit_shared(self, req: Request, block_ids: list[int], row: SampleRow,
                      step: _StepBuilder) -> None:
        """Admit `req` on a prompt that is computed (or being computed in this step)."""
        self.pool.touch(block_ids)
        req.block_ids = list(block_ids)
        req.blocks_changed = True
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.scheduled[req.request_id] = req
        self.stats.prefix_cache_queries += req.num_prompt_tokens
        self.stats.prefix_cache_hits += req.num_prompt_tokens
        self.stats.prompt_tokens_cached += req.num_prompt_tokens
        step.samples.append(row)

    def _add_chunk(self, req: Request, num_new: int, step: _StepBuilder,
                   draft: tuple[int, ...] = ()) -> None:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        sample = req.num_computed_tokens - len(draft) == req.num_tokens
        step.chunks.append(ScheduledChunk(req.request_id, start, num_new, sample, draft))
        step.scheduled[req.request_id] = req
        if sample:
            step.samples.append(SampleRow(req.request_id, computed_by=req.request_id))
        if start < req.num_prompt_tokens:
            self.stats.prompt_tokens_computed += min(req.num_computed_tokens,
                                                     req.num_prompt_tokens) - start
        entry = req.share_entry
        if sample and entry is not None and entry.owner is req and not req.output_token_ids:
            self._finishing_owner(req, entry, step)

    def _finishing_owner(self, req: Request, entry: InFlightPrompt, step: _StepBuilder) -> None:
        """The owner computes its prompt's last token now: reserve a kept-logits slot for
        its row, and admit the parked followers into this step."""
        entry.final_step = self.step_idx
        # A prompt scored for its logprobs is not kept: a later request would need the scores.
        entry.keep_slot = None if req.needs_prompt_logprobs else self.share.reserve_slot()
        if entry.keep_slot is not None:
            step.keep_logits.append((req.request_id, entry.keep_slot))
        self._record.finishing_owners.append(req)
        num_prompt_blocks = cdiv(req.num_prompt_tokens, self.block_size)
        while entry.followers and len(self.running) < self.max_num_seqs:
            follower = entry.followers.pop(0)
            follower.share_entry = None
            self._admit_shared(follower, req.block_ids[:num_prompt_blocks],
                               SampleRow(follower.request_id, computed_by=req.request_id), step)

    # ---------------------------------------------------------------- after the step
    def update_from_output(self, out: SchedulerOutput) -> None:
        """The step ran: prompts whose end it computed become kept prompts, and their
        followers still parked (over `max_num_seqs`) go back to the queue's front."""
        for owner in self._record.finishing_owners:
            entry = owner.share_entry
            if entry is None or entry.owner is not owner:
                continue
            num_full = owner.num_prompt_tokens // self.block_size
            hashes = list(owner.block_hashes[:num_full])
            if owner.partial_block_hash is not None:
                hashes.append(owner.partial_block_hash)
            followers = self.share.publish(entry, hashes)
            self.waiting.extendleft(reversed(followers))
        self._record = _StepRecord()

    def fail_step(self, out: SchedulerOutput) -> None:
        """The step's forward pass failed: blocks it was to fill hold no valid K/V, and the
        slots reserved for its prompts' logits were never written."""
        self.pool.forget(self._record.new_block_ids)
        self.pool.forget(self._record.registered_block_ids)
        for owner in self._record.finishing_owners:
            if owner.share_entry is not None and owner.share_entry.owner is owner:
                self.share.abandon_final_step(owner.share_entry)
        self._record = _StepRecord()

    def verified(self, req: Request, start: int, num_kept: int) -> None:
        """A speculative chunk of `req` that started at `start` kept `num_kept` tokens
        (the last known one and the accepted drafts; the core has appended the accepted
        drafts and the model's own next token to the output). Roll back to them: only
        positions [0, start + num_kept) hold verified K/V; blocks past them are freed, and
        the blocks they filled become findable by content (never before: a registered
        block holds verified tokens only).

            block size 4, start 5, draft of 4, 2 accepted (num_kept 3):
            blocks  [0 1 2 3][4 5 6 7][8 9 . .]       kept: positions 0..7
            K/V      v v v v  v v v v  x x            x: rejected drafts, overwritten later
            block 1 becomes full and registered; block 2 is freed
        """
        num_computed = start + num_kept
        if req.num_computed_tokens < num_computed:
            raise ValueError(f"{req.request_id}: {num_kept} kept tokens from {start}, "
                             f"only {req.num_computed_tokens} computed")
        req.num_computed_tokens = num_computed
        num_blocks = cdiv(num_computed, self.block_size)
        if len(req.block_ids) > num_blocks:
            self.pool.free(req.block_ids[num_blocks:])
            del req.block_ids[num_blocks:]
            req.blocks_changed = True
        if self.pool.enable_caching:
            self._register_full(req, (start + 1) // self.block_size,
                                num_computed // self.block_size)

    # ---------------------------------------------------------------- blocks
    def _allocate(self, req: Request, num_new: int, step: _StepBuilder,
                  num_draft: int = 0) -> bool:
        """Make room for tokens [computed, computed + num_new); False if the pool is short.
        The last `num_draft` of them are unverified drafts: the blocks they fill are not
        registered now (`verified` registers those the model accepts).

        A write into a last block that others still reference, or that is findable by
        content (a kept prompt's partial block), first copies it."""
        start = req.num_computed_tokens
        end = start + num_new
        bs = self.block_size
        num_needed = cdiv(end, bs) - len(req.block_ids)
        last = req.block_ids[-1] if req.block_ids else None
        copy_on_write = (start % bs != 0 and last is not None
                         and (self.pool.ref_count(last) > 1 or self.pool.is_hashed(last)))
        if num_needed + copy_on_write > self.pool.num_free_blocks:
            return False
        if copy_on_write:
            assert last is not None
            (private,) = self.pool.allocate(1)
            step.block_copies.append((last, private))
            self._record.new_block_ids.append(private)
            self.pool.free([last])
            req.block_ids[-1] = private
            req.blocks_changed = True
        if num_needed > 0:
            new_ids = self.pool.allocate(num_needed)
            req.block_ids.extend(new_ids)
            req.blocks_changed = True
            self._record.new_block_ids.extend(new_ids)
        if not self.pool.enable_caching:
            return True
        # Blocks that become full in this step are registered now, so a request scheduled
        # later in this step (or later) can share them.
        self._register_full(req, start // bs, (end - num_draft) // bs)
        # An owner's partial last prompt block is registered too: a kept prompt names it
        # (so it is copied before any write; pointless when no prompt is ever kept).
        entry = req.share_entry
        num_prompt = req.num_prompt_tokens
        if (end == num_prompt and num_prompt % bs and entry is not None and entry.owner is req
                and not req.output_token_ids and self.share.max_kept > 0
                and not req.needs_prompt_logprobs):
            self._extend_hashes(req, num_prompt // bs)
            parent = req.block_hashes[num_prompt // bs - 1] if num_prompt >= bs else None
            req.partial_block_hash = hash_partial_block(
                parent, req.prompt_token_ids[num_prompt // bs * bs:], req.extra_key)
            self._register(req.block_ids[-1], req.partial_block_hash)
        return True

    def _register_full(self, req: Request, first_full: int, last_full: int) -> None:
        """Register `req`'s full blocks [first_full, last_full) under their content hash."""
        if last_full <= first_full:
            return
        bs = self.block_size
        self._extend_hashes(req, last_full)
        for idx in range(first_full, last_full):
            if self.pool.events is None:
                self._register(req.block_ids[idx], req.block_hashes[idx])
            else:  # KV events announce a full block with its parent and tokens
                self._register(req.block_ids[idx], req.block_hashes[idx],
                               req.block_hashes[idx - 1] if idx else None,
                               req.token_ids(idx * bs, (idx + 1) * bs))

    def _register(self, block_id: int, block_hash: bytes, parent_hash: bytes | None = None,
                  token_ids: list[int] | None = None) -> None:
        self.pool.register(block_id, block_hash, parent_hash, token_ids)
        self._record.registered_block_ids.append(block_id)

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        bs = self.block_size
        for idx in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[idx - 1] if idx else None
            tokens = req.token_ids(idx * bs, (idx + 1) * bs)
            req.block_hashes.append(hash_block(parent, tokens, req.extra_key))

    def _preempt(self, req: Request, step: _StepBuilder) -> None:
        """Recompute later: free the blocks (they stay cached), back to the queue front."""
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.blocks_changed = True
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req.request_id)

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        entry = req.share_entry
        if entry is not None and entry.owner is req:
            followers = self.share.drop_owner(entry)
            self.waiting.extendleft(reversed(followers))
