"""Prefill once for identical prompts: in-flight owners, parked followers, kept logits.

The first request with a given prompt becomes the entry's *owner* and computes it (with
full-block prefix caching and chunked prefill as usual). Requests with the same prompt that
arrive while it computes are *parked* on the entry. In the step that computes the owner's
last prompt token they are admitted too: they take references on the owner's blocks,
including the partial last block (shared read-only, copied on write), and sample from the
owner's logits row in that same step. Afterwards the entry keeps the logits row and pins the
prompt's blocks, so a later identical prompt skips the forward pass entirely. Kept entries
are bounded (LRU by count) and are the first thing dropped under memory pressure.

    owner:     [b0 full][b1 full][b2 partial] -> forward -> logits row r
    follower:  [b0     ][b1     ][b2        ] (refs)     -> samples from r, own seed
    follower's first write into b2 -> private copy of b2 (copy-on-write)

This module is pure bookkeeping; it never touches tensors (`logits` is opaque here).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from plait.engine.block_pool import BlockPool
from plait.engine.request import Request


def prompt_key(prompt_token_ids: list[int], extra_key: str | None) -> bytes:
    digest = hashlib.sha256(array("q", prompt_token_ids).tobytes())
    digest.update(len(prompt_token_ids).to_bytes(8, "little"))
    if extra_key is not None:
        digest.update(extra_key.encode())
    return digest.digest()[:16]


@dataclass(eq=False)
class ShareEntry:
    key: bytes
    owner: Request | None
    followers: list[Request] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # pinned once ready
    logits: Any = None  # the last prompt position's logits row once ready
    # The scheduler step in which the owner computes the prompt's last token, if scheduled.
    final_step: int | None = None

    @property
    def ready(self) -> bool:
        return self.logits is not None


class PromptShareTable:
    """In-flight and ready share entries. Ready ones hold one ref on each prompt block."""

    def __init__(self, pool: BlockPool, max_ready: int) -> None:
        self.pool = pool
        self.max_ready = max_ready
        self.in_flight: dict[bytes, ShareEntry] = {}
        self.ready: OrderedDict[bytes, ShareEntry] = OrderedDict()

    def lookup(self, key: bytes) -> ShareEntry | None:
        entry = self.ready.get(key)
        if entry is not None:
            self.ready.move_to_end(key)
            return entry
        return self.in_flight.get(key)

    def start(self, key: bytes, owner: Request) -> ShareEntry:
        entry = ShareEntry(key, owner)
        self.in_flight[key] = entry
        owner.share_entry = entry
        return entry

    def publish(self, entry: ShareEntry, logits: Any, block_ids: list[int]) -> list[Request]:
        """The owner computed the prompt: keep `logits`, pin `block_ids`, return the parked
        followers (to be re-queued; they will hit this entry)."""
        followers = self._close(entry)
        if self.max_ready > 0:
            entry.logits = logits
            entry.block_ids = list(block_ids)
            self.pool.touch(entry.block_ids)
            self.ready[entry.key] = entry
            while len(self.ready) > self.max_ready:
                self.evict_one()
        return followers

    def drop_owner(self, entry: ShareEntry) -> list[Request]:
        """The owner left before computing the prompt: forget the entry, return the parked
        followers (the first one re-queued becomes the next owner)."""
        return self._close(entry)

    def _close(self, entry: ShareEntry) -> list[Request]:
        """End the in-flight phase: detach owner and followers, return the followers."""
        self.in_flight.pop(entry.key, None)
        if entry.owner is not None:
            entry.owner.share_entry = None
        entry.owner = None
        followers, entry.followers = entry.followers, []
        for follower in followers:
            follower.share_entry = None
        return followers

    def park(self, entry: ShareEntry, request: Request) -> None:
        entry.followers.append(request)
        request.share_entry = entry

    def unpark(self, request: Request) -> None:
        entry = request.share_entry
        if entry is not None and request in entry.followers:
            entry.followers.remove(request)
            request.share_entry = None

    def evict_one(self) -> bool:
        """Drop the least recently used ready entry; False when there is none."""
        if not self.ready:
            return False
        _, entry = self.ready.popitem(last=False)
        self.pool.free(entry.block_ids)
        entry.block_ids, entry.logits = [], None
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass
