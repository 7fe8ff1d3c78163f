"""KV block pool: fixed blocks, ref counts, content hashes and an LRU of free blocks.

A block is one of three things:

    in use      ref_cnt > 0; its hash (if full) lets other requests share it
    cached      ref_cnt == 0 but hash kept; sits in the free queue, reusable on a hit
    free        ref_cnt == 0, no hash

The free queue is ordered least-recently-freed first. `allocate` takes from its head, so a
cached block is evicted least-recently-used first. `free` releases a request's blocks tail
first, so the tail of a prefix chain is evicted before its head (a later request that
shares only the head still hits).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from plait.engine.kv_events import KVEventLog


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_key: str | None) -> bytes:
    """Content hash of one full block: its tokens, everything before it, and `extra_key`."""
    digest = hashlib.sha256(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(extra_key.encode())
    return digest.digest()[:16]


def hash_partial_block(parent_hash: bytes | None, token_ids: Sequence[int],
                       extra_key: str | None) -> bytes:
    """Content hash of a prompt's partial last block (fewer than block_size tokens). Kept
    apart from full-block hashes, so prefix matching of full blocks never finds it."""
    return hash_block(parent_hash, [-1, *token_ids], extra_key)


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    published: bool = False  # its hash was announced in a KV event (full blocks only)
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks: O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """Owns every KV block. Callers (the scheduler) work with block ids.

    Contract: `allocate` only when `num_free_blocks` suffices; every id handed out (by
    `allocate`, or taken with `touch`) is given back exactly once per reference via `free`.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_queries = 0
        self.num_hits = 0
        # KV-cache events (engine/kv_events.py): full blocks entering and leaving the cache.
        self.events = KVEventLog() if record_events and enable_caching else None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks from the free queue's head (evicting cached ones), ref 1 each."""
        if num > self.free_queue.num_free:
            raise RuntimeError(f"asked for {num} KV blocks, {self.free_queue.num_free} free")
        ids = []
        for _ in range(num):
            block = self.free_queue.popleft()
            self._drop_hash(block)
            block.ref_cnt = 1
            ids.append(block.block_id)
        return ids

    def lookup(self, block_hash: bytes) -> int | None:
        """The id of the block holding content `block_hash`, or None. Counts a query."""
        self.num_queries += 1
        block = self.cached.get(block_hash) if self.enable_caching else None
        if block is None:
            return None
        self.num_hits += 1
        return block.block_id

    def cached_block(self, block_hash: bytes) -> int | None:
        """The id of the block holding `block_hash`, or None (no query counted)."""
        block = self.cached.get(block_hash)
        return None if block is None else block.block_id

    def is_hashed(self, block_id: int) -> bool:
        """True if the block is findable by content; its K/V must then never change."""
        return self.blocks[block_id].block_hash is not None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (reviving cached ones)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def register(self, block_id: int, block_hash: bytes, parent_hash: bytes | None = None,
                 token_ids: list[int] | None = None) -> None:
        """Make `block_id` findable under `block_hash` unless another block already is.
        With `token_ids` (a full block's tokens; `parent_hash` its predecessor's hash) the
        block is announced in the KV events; a partial block is registered without them."""
        if not self.enable_caching or block_hash in self.cached:
            return
        block = self.blocks[block_id]
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None and token_ids is not None:
            block.published = True
            self.events.stored(block_hash, parent_hash, token_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per id, tail first; blocks reaching 0 join the free queue."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def forget(self, block_ids: Iterable[int]) -> None:
        """Remove the hashes of blocks whose content is not valid (a failed step)."""
        for block_id in block_ids:
            self._drop_hash(self.blocks[block_id])

    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            if block.published:
                block.published = False
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
