"""engine/kv_warm.py: the idle-time warming of the CPU KV cache's next blocks, its calls
recorded, its pages read back with mincore(2) (tests/helpers/pages.py), the engine's
choice of a window, and an idle engine thread warming it."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from helpers.pages import resident_pages

from plait.engine.async_engine import AsyncEngine
from plait.engine.block_pool import BlockPool
from plait.engine.config import EngineConfig
from plait.engine.host_memory import kv_zeros
from plait.engine.kv_warm import RUN_BLOCKS, KVWarmer, kv_warmer

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 64, 16, 2, 32
# bytes of one block in one (layer, K|V) region: 16 tokens x 2 heads x 32 floats = 4 KiB
BLOCK_BYTES = BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4


def _cache(blocks: int = BLOCKS) -> torch.Tensor:
    return kv_zeros((LAYERS, 2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
                               torch.float32)


class Recorder:
    """A `populate` that records (address, length) and answers `ok`."""

    def __init__(self, ok: bool = True) -> None:
        self.calls: list[tuple[int, int]] = []
        self.ok = ok

    def __call__(self, address: int, length: int) -> bool:
        self.calls.append((address, length))
        return self.ok


def _blocks_of(calls: list[tuple[int, int]], kv: torch.Tensor) -> list[tuple[int, int, int]]:
    """(region, first block, blocks) of each call, from its address and length."""
    region_bytes = BLOCKS * BLOCK_BYTES
    out = []
    for address, length in calls:
        region, at = divmod(address - kv.data_ptr(), region_bytes)
        assert at % BLOCK_BYTES == 0 and length % BLOCK_BYTES == 0
        out.append((region, at // BLOCK_BYTES, length // BLOCK_BYTES))
    return out


def test_the_window_is_warmed_in_runs_over_every_region_then_nothing_is_left() -> None:
    kv, pool, populate = _cache(), BlockPool(BLOCKS), Recorder()
    warmer = KVWarmer(kv, pool, window_blocks=10, populate=populate)
    assert warmer.pending() == list(range(10))
    assert warmer.step(budget_s=0.0)  # one run per call with no time to spare
    assert _blocks_of(populate.calls, kv) == [(r, 0, RUN_BLOCKS) for r in range(LAYERS * 2)]
    while warmer.step(budget_s=0.0):
        pass
    runs = sorted({(first, n) for _, first, n in _blocks_of(populate.calls, kv)})
    assert runs == [(0, 4), (4, 4), (8, 2)]
    assert len(populate.calls) == 3 * LAYERS * 2
    assert warmer.pending() == [] and not warmer.step()
    assert len(populate.calls) == 3 * LAYERS * 2  # nothing again


def test_the_window_follows_the_free_queue_as_blocks_are_taken_and_freed() -> None:
    kv, pool, populate = _cache(), BlockPool(BLOCKS), Recorder()
    warmer = KVWarmer(kv, pool, window_blocks=8, populate=populate)
    while warmer.step():
        pass
    taken = pool.allocate(6)  # 0..5 leave the queue: 6..13 are its first eight
    assert taken == list(range(6))
    assert warmer.pending() == list(range(8, 14))
    populate.calls.clear()
    while warmer.step():
        pass
    assert sorted({(first, n) for _, first, n in _blocks_of(populate.calls, kv)}) == \
        [(8, 4), (12, 2)]
    pool.free(taken)  # back at the tail: past the window, not pending
    assert warmer.pending() == []
    pool.allocate(BLOCKS - 6 - 2)  # everything but two free blocks and the freed six
    assert [b.block_id for b in pool.free_queue] == [62, 63, 5, 4, 3, 2, 1, 0]
    assert warmer.pending() == [62, 63]  # 0..5 were warmed before


def test_a_refused_populate_turns_warming_off_for_good() -> None:
    kv, pool, populate = _cache(), BlockPool(BLOCKS), Recorder(ok=False)
    warmer = KVWarmer(kv, pool, window_blocks=8, populate=populate)
    assert not warmer.step()
    assert len(populate.calls) == 1
    assert not warmer.step() and len(populate.calls) == 1
    assert not KVWarmer(kv, pool, window_blocks=0, populate=populate).step()


def test_a_warmer_refuses_a_cache_that_is_not_the_pools() -> None:
    with pytest.raises(ValueError, match="holds 64 blocks, the pool 32"):
        KVWarmer(_cache(), BlockPool(32), window_blocks=8)
    with pytest.raises(ValueError, match="contiguous CPU"):
        KVWarmer(_cache().transpose(0, 1), BlockPool(BLOCKS), window_blocks=8)


def _warm_all(kv: torch.Tensor, pool: BlockPool, window: int) -> None:
    warmer = KVWarmer(kv, pool, window_blocks=window)
    if not warmer.step(budget_s=10.0) and warmer.pending():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE (Linux < 5.14)")
    assert warmer.pending() == []


def test_warming_makes_the_windows_pages_resident_and_no_others() -> None:
    """The real MADV_POPULATE_WRITE: the window's pages in every region become resident,
    blocks far past it stay untouched. Blocks of 4 KiB are whole pages; a region is 8 MiB
    (four 2 MiB huge pages), the window lies in its second huge page, the blocks read past
    it in its fourth."""
    blocks = 2048
    kv, pool = _cache(blocks), BlockPool(blocks)
    pool.allocate(600)  # the window starts at block 600
    _warm_all(kv, pool, window=16)
    for layer in range(LAYERS):
        for k_or_v in range(2):
            region = kv[layer, k_or_v]
            assert all(resident_pages(region[600].data_ptr(), 16 * BLOCK_BYTES))
            assert not any(resident_pages(region[1600].data_ptr(), 100 * BLOCK_BYTES))
    assert not bool(kv.any())


def test_warming_keeps_what_the_blocks_hold() -> None:
    kv, pool = _cache(), BlockPool(BLOCKS)
    values = torch.randn(LAYERS, 2, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kv[:, :, :8] = values
    _warm_all(kv, pool, window=16)
    assert torch.equal(kv[:, :, :8], values) and not bool(kv[:, :, 8:].any())


@pytest.mark.parametrize(("warm_tokens", "prefault", "window"),
                         [(2048, False, 2048 // 16), (100, False, 7), (0, False, None),
                          (2048, True, None)])
def test_the_engine_warms_a_window_of_kv_cache_warm_tokens(
        warm_tokens: int, prefault: bool, window: int | None) -> None:
    config = EngineConfig(kv_cache_warm_tokens=warm_tokens, kv_cache_prefault=prefault)
    pool = BlockPool(4096)
    warmer = kv_warmer(config, _cache(4096), pool)
    assert (warmer.window if warmer else None) == window
    assert kv_warmer(EngineConfig(kv_cache_warm_tokens=64), None, pool) is None  # no cache
    assert kv_warmer(EngineConfig(), _cache(4096), pool) is None  # off by default


def test_kv_cache_warm_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_warm_tokens must be >= 0"):
        EngineConfig(kv_cache_warm_tokens=-1)


def test_an_idle_engine_thread_warms_the_window(tiny_path) -> None:
    """The engine loop (AsyncEngine's thread) warms the window with no request: not
    resident after loading, resident once the loop has been idle."""
    engine = AsyncEngine(EngineConfig(model=str(tiny_path), num_kv_blocks=4096,
                                      kv_cache_warm_tokens=64 * 16, warm_up_tokens=0))
    engine.load()
    core = engine.core
    assert core is not None and core.warmer is not None
    kv = core.runner.kv_cache
    regions = [kv[layer, k_or_v] for layer in range(kv.shape[0]) for k_or_v in range(2)]
    window_bytes = 64 * regions[0][0].nbytes
    assert not any(resident_pages(regions[-1][0].data_ptr(), window_bytes))
    loop = asyncio.new_event_loop()
    engine.start(loop)
    try:
        deadline = time.monotonic() + 30
        while core.warmer.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.warmer.pending() == []
        for region in regions:
            assert all(resident_pages(region[0].data_ptr(), window_bytes))
    finally:
        engine.shutdown()
        loop.close()
