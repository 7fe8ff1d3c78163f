"""Prefill once for identical prompts: in-flight owners, parked followers, kept prompts.

The first request with a given prompt becomes the in-flight entry's *owner* and computes it
(with full-block prefix caching and chunked prefill as usual). Requests with the same prompt
that arrive while it computes are *parked* on the entry. In the step that computes the
owner's last prompt token they are admitted too: they take references on the owner's
blocks, including the partial last block (shared read-only, copied on write), and sample
from the owner's logits row in that same step.

When that step succeeds the prompt is *kept*: a `KeptPrompt` names its blocks by content
hash (full blocks, then the partial last block under its own hash) and a slot of the
runner's kept-logits buffer. It owns nothing: the blocks stay ordinary cached blocks
(ref count 0, in the pool's one LRU) and the entry is valid only while every hash still
resolves. A later identical prompt that finds a valid entry skips the forward pass: it
revives the blocks and samples from the kept slot.

    owner:     [b0 full][b1 full][b2 partial] -> forward -> logits row -> kept slot k
    follower:  [b0     ][b1     ][b2        ] (refs)     -> samples from the row, own seed
    any write into b2 (hashed, so immutable) -> private copy of b2 (copy-on-write)

Requests asking for prompt logprobs share the same way under a key of their own (see
`prompt_key`): the owner scores every prompt position, its followers get a copy of the
scores, and nothing is kept.

Pure bookkeeping: no tensors, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from plait.engine.block_pool import BlockPool
from plait.engine.request import Request


def prompt_key(prompt_token_ids: list[int], extra_key: str | None,
               prompt_logprobs: int | None = None) -> bytes:
    """The share key of a prompt. Requests that want `prompt_logprobs=k` share among
    themselves only (a key of their own per k): their owner computes every prompt position
    with its logprobs, which its followers copy (engine/core.py), and such a prompt is never
    kept, since a kept prompt holds logits of the last position only."""
    digest = hashlib.sha256(array("q", prompt_token_ids).tobytes())
    digest.update(len(prompt_token_ids).to_bytes(8, "little"))
    if prompt_logprobs is not None:
        digest.update(b"\x00prompt_logprobs" + prompt_logprobs.to_bytes(4, "little"))
    if extra_key is not None:
        digest.update(extra_key.encode())
    return digest.digest()[:16]


@dataclass(eq=False)
class InFlightPrompt:
    """A prompt being computed by `owner`, with the identical requests parked on it."""

    key: bytes
    owner: Request | None
    followers: list[Request] = field(default_factory=list)
    # The scheduler step in which the owner computes the prompt's last token, if scheduled.
    final_step: int | None = None
    keep_slot: int | None = None  # kept-logits slot reserved for that step's row


@dataclass(frozen=True, slots=True)
class KeptPrompt:
    """A computed prompt, valid while each of `block_hashes` names a cached block."""

    key: bytes
    block_hashes: tuple[bytes, ...]  # the prompt's blocks in order (last may be partial)
    slot: int  # row of the runner's kept-logits buffer


class PromptShareTable:
    """In-flight and kept prompts. Holds no block reference and no logits."""

    def __init__(self, pool: BlockPool, max_kept: int) -> None:
        self.pool = pool
        self.max_kept = max_kept
        self.in_flight: dict[bytes, InFlightPrompt] = {}
        self.kept: OrderedDict[bytes, KeptPrompt] = OrderedDict()
        self._free_slots = list(range(max_kept - 1, -1, -1))

    # ---------------------------------------------------------------- kept prompts
    def resolve_kept(self, key: bytes) -> tuple[KeptPrompt, list[int]] | None:
        """The kept entry for `key` and its block ids, if every block is still cached; a
        stale entry (a block was evicted) is dropped."""
        entry = self.kept.get(key)
        if entry is None:
            return None
        cached = [self.pool.cached_block(h) for h in entry.block_hashes]
        block_ids = [b for b in cached if b is not None]
        if len(block_ids) < len(cached):
            self._drop(entry)
            return None
        self.kept.move_to_end(key)
        return entry, block_ids

    def reserve_slot(self) -> int | None:
        """A free kept-logits slot, evicting the least recently used entry if none is free;
        None when keeping is off (`max_kept` 0)."""
        if not self._free_slots and self.kept:
            self._drop(next(iter(self.kept.values())))
        return self._free_slots.pop() if self._free_slots else None

    def release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def _drop(self, entry: KeptPrompt) -> None:
        del self.kept[entry.key]
        self._free_slots.append(entry.slot)

    # ---------------------------------------------------------------- in-flight prompts
    def start(self, key: bytes, owner: Request) -> InFlightPrompt:
        entry = InFlightPrompt(key, owner)
        self.in_flight[key] = entry
        owner.share_entry = entry
        return entry

    def publish(self, entry: InFlightPrompt, block_hashes: list[bytes]) -> list[Request]:
        """The owner's step succeeded: keep the prompt (if a slot was reserved) under
        `block_hashes`; return the followers still parked (to re-queue: they hit it)."""
        slot, entry.keep_slot = entry.keep_slot, None
        followers = self._close(entry)
        if slot is not None:
            self.kept.pop(entry.key, None)
            self.kept[entry.key] = KeptPrompt(entry.key, tuple(block_hashes), slot)
        return followers

    def abandon_final_step(self, entry: InFlightPrompt) -> None:
        """The step that was to compute the prompt's end failed: free its reserved slot."""
        entry.final_step = None
        if entry.keep_slot is not None:
            self.release_slot(entry.keep_slot)
            entry.keep_slot = None

    def drop_owner(self, entry: InFlightPrompt) -> list[Request]:
        """The owner left before computing the prompt: forget the entry, return the parked
        followers (the first one re-queued becomes the next owner)."""
        self.abandon_final_step(entry)
        return self._close(entry)

    def _close(self, entry: InFlightPrompt) -> list[Request]:
        """End the in-flight phase: detach owner and followers, return the followers."""
        self.in_flight.pop(entry.key, None)
        if entry.owner is not None:
            entry.owner.share_entry = None
        entry.owner = None
        followers, entry.followers = entry.followers, []
        for follower in followers:
            follower.share_entry = None
        return followers

    def park(self, entry: InFlightPrompt, request: Request) -> None:
        entry.followers.append(request)
        request.share_entry = entry

    def unpark(self, request: Request) -> None:
        entry = request.share_entry
        if entry is not None and request in entry.followers:
            entry.followers.remove(request)
            request.share_entry = None

    @property
    def num_parked(self) -> int:
        return sum(len(e.followers) for e in self.in_flight.values())
