"""KV block pool: exact block ids, ref counts, free-queue order and LRU eviction of cache
entries. Pure bookkeeping, no model: every test builds a pool of a few blocks.

    fresh pool of 6:   free queue  [0 1 2 3 4 5]   (allocate takes from the left)
    free([0, 1, 2]):   appended tail first -> [... 2 1 0], so a chain's tail is evicted
                       before its head and a later request sharing only the head still hits
"""

from __future__ import annotations

import pytest

from plait.engine.block_pool import BlockPool, hash_block


def free_order(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def chain_hashes(num_blocks: int, first_token: int = 0, extra_key: str | None = None):
    """Hashes of a prefix chain of `num_blocks` full 4-token blocks."""
    hashes: list[bytes] = []
    for idx in range(num_blocks):
        tokens = range(first_token + 4 * idx, first_token + 4 * idx + 4)
        hashes.append(hash_block(hashes[-1] if hashes else None, list(tokens), extra_key))
    return hashes


def cached_chain(pool: BlockPool, hashes: list[bytes]) -> list[int]:
    """Allocate one block per hash, register it, and free the chain (it stays cached)."""
    block_ids = pool.allocate(len(hashes))
    for block_id, block_hash in zip(block_ids, hashes, strict=True):
        pool.register(block_id, block_hash)
    pool.free(block_ids)
    return block_ids


def hits(pool: BlockPool, hashes: list[bytes]) -> list[int | None]:
    return [pool.lookup(h) for h in hashes]


# --- allocate / free / touch ---------------------------------------------------------------

def test_allocate_hands_out_ids_in_free_queue_order() -> None:
    pool = BlockPool(6)
    assert free_order(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert [pool.ref_count(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]
    assert free_order(pool) == [5]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 5)
    assert pool.allocate(0) == []


def test_allocate_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(6)
    pool.allocate(4)
    with pytest.raises(RuntimeError, match="asked for 3 KV blocks, 2 free"):
        pool.allocate(3)
    assert free_order(pool) == [4, 5]
    assert pool.allocate(2) == [4, 5]


def test_free_appends_tail_first_and_ref_counts_drop() -> None:
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.touch([1, 2])  # a second holder of the last two blocks
    assert [pool.ref_count(i) for i in range(3)] == [1, 2, 2]
    pool.free([0, 1, 2])
    assert [pool.ref_count(i) for i in range(3)] == [0, 1, 1]
    assert free_order(pool) == [3, 4, 5, 0]
    pool.free([1, 2])
    assert [pool.ref_count(i) for i in range(3)] == [0, 0, 0]
    assert free_order(pool) == [3, 4, 5, 0, 2, 1]
    assert pool.allocate(6) == [3, 4, 5, 0, 2, 1]


def test_freeing_more_than_taken_raises() -> None:
    pool = BlockPool(6)
    with pytest.raises(RuntimeError, match="KV block 0 freed more often than taken"):
        pool.free([0])
    (block_id,) = pool.allocate(1)
    pool.touch([block_id])
    pool.free([block_id])
    pool.free([block_id])
    with pytest.raises(RuntimeError, match=f"KV block {block_id} freed more often than taken"):
        pool.free([block_id])
    assert pool.ref_count(block_id) == 0
    assert free_order(pool) == [1, 2, 3, 4, 5, 0]


# --- cache entries and eviction order ------------------------------------------------------

@pytest.mark.parametrize("num_taken,expected_ids,still_cached", [
    (1, [2], [0, 1, None]),
    (2, [2, 1], [0, None, None]),
    (3, [2, 1, 0], [None, None, None]),
])
def test_freed_chain_is_evicted_tail_first(num_taken, expected_ids, still_cached) -> None:
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]  # held by someone else the whole test
    hashes = chain_hashes(3)
    assert cached_chain(pool, hashes) == [3, 4, 5]
    assert free_order(pool) == [5, 4, 3]
    assert hits(pool, hashes) == [3, 4, 5]
    taken = pool.allocate(num_taken)
    assert taken == [i + 3 for i in expected_ids]
    assert hits(pool, hashes) == [None if i is None else i + 3 for i in still_cached]


def test_fresh_blocks_are_used_before_cached_ones() -> None:
    pool = BlockPool(6)
    hashes = chain_hashes(3)
    assert cached_chain(pool, hashes) == [0, 1, 2]
    assert free_order(pool) == [3, 4, 5, 2, 1, 0]
    assert pool.allocate(3) == [3, 4, 5]
    assert hits(pool, hashes) == [0, 1, 2]
    assert pool.allocate(2) == [2, 1]
    assert hits(pool, hashes) == [0, None, None]


def test_touch_revives_a_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(6)
    pool.allocate(3)
    hashes = chain_hashes(3)
    cached_chain(pool, hashes)  # blocks 3, 4, 5; free queue [5 4 3]
    head = pool.lookup(hashes[0])
    assert head == 3
    pool.touch([head])
    assert pool.ref_count(head) == 1
    assert free_order(pool) == [5, 4]
    assert pool.allocate(2) == [5, 4]
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)
    assert hits(pool, hashes) == [3, None, None]  # the revived head keeps its content
    pool.free([head])
    assert free_order(pool) == [3]
    assert pool.lookup(hashes[0]) == 3


def test_lru_across_two_chains_freed_at_different_times() -> None:
    pool = BlockPool(6)
    older, newer = chain_hashes(2, first_token=0), chain_hashes(2, first_token=100)
    assert cached_chain(pool, older) == [0, 1]
    assert cached_chain(pool, newer) == [2, 3]
    assert free_order(pool) == [4, 5, 1, 0, 3, 2]
    assert pool.allocate(3) == [4, 5, 1]
    assert hits(pool, older) == [0, None]
    assert hits(pool, newer) == [2, 3]
    # Reusing the older chain's head makes it the most recently freed entry.
    pool.touch([0])
    pool.free([0])
    assert free_order(pool) == [3, 2, 0]
    assert pool.allocate(2) == [3, 2]
    assert hits(pool, older) == [0, None]
    assert hits(pool, newer) == [None, None]


def test_register_does_not_overwrite_an_existing_hash() -> None:
    pool = BlockPool(6)
    (block_hash,) = chain_hashes(1)
    assert pool.allocate(2) == [0, 1]
    pool.register(0, block_hash)
    pool.register(1, block_hash)  # same content computed twice: the first block stays
    assert pool.lookup(block_hash) == 0
    assert pool.blocks[1].block_hash is None
    pool.free([1])
    assert pool.allocate(5) == [2, 3, 4, 5, 1]  # reusing block 1 does not drop the entry
    assert pool.lookup(block_hash) == 0
    pool.free([0])
    pool.allocate(1)  # block 0 evicted: the content is gone
    assert pool.lookup(block_hash) is None


def test_lookup_counts_queries_and_hits() -> None:
    pool = BlockPool(6)
    hashes = chain_hashes(3)
    cached_chain(pool, hashes[:2])
    assert (pool.num_queries, pool.num_hits) == (0, 0)
    assert hits(pool, hashes) == [0, 1, None]
    assert (pool.num_queries, pool.num_hits) == (3, 2)
    assert pool.lookup(hashes[0]) == 0
    assert (pool.num_queries, pool.num_hits) == (4, 3)


def test_disabled_caching_never_registers_or_hits() -> None:
    pool = BlockPool(6, enable_caching=False)
    hashes = chain_hashes(2)
    assert cached_chain(pool, hashes) == [0, 1]
    assert pool.cached == {}
    assert hits(pool, hashes) == [None, None]
    assert (pool.num_queries, pool.num_hits) == (2, 0)
    assert free_order(pool) == [2, 3, 4, 5, 1, 0]


def test_forget_drops_only_the_named_hashes() -> None:
    pool = BlockPool(6)
    hashes = chain_hashes(3)
    block_ids = pool.allocate(3)
    for block_id, block_hash in zip(block_ids, hashes, strict=True):
        pool.register(block_id, block_hash)
    pool.forget([1])
    assert hits(pool, hashes) == [0, None, 2]
    assert [pool.ref_count(i) for i in block_ids] == [1, 1, 1]  # references are untouched
    pool.free(block_ids)
    assert free_order(pool) == [3, 4, 5, 2, 1, 0]
    pool.register(4, hashes[1])  # the hash is free again for another block
    assert pool.lookup(hashes[1]) == 4


# --- hashing -------------------------------------------------------------------------------

def test_hash_block_depends_on_parent_tokens_and_extra_key() -> None:
    tokens = [5, 6, 7, 8]
    base = hash_block(None, tokens, None)
    assert hash_block(None, list(tokens), None) == base
    assert len(base) == 16
    parent = hash_block(None, [1, 2, 3, 4], None)
    variants = [
        hash_block(parent, tokens, None),
        hash_block(hash_block(None, [1, 2, 3, 5], None), tokens, None),
        hash_block(None, [5, 6, 7, 9], None),
        hash_block(None, [8, 7, 6, 5], None),
        hash_block(None, tokens, "lora-a"),
        hash_block(None, tokens, "lora-b"),
        hash_block(parent, tokens, "lora-a"),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    assert hash_block(parent, tokens, "lora-a") == variants[-1]
