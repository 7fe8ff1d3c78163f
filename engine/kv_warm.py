"""Warming the CPU KV cache at idle: the pages of the blocks the pool hands out next are
made resident while the engine has nothing to compute, so a step does not pay their first
write.

The CPU cache is one lazily backed mapping (engine/kv_cache.py): a page becomes resident
when K/V is first written to it, inside a step. On a VM whose host backs guest memory
lazily that fault is slow: measured on the benchmark VM, a 521-token prefill of the default
model with a bf16 cache took 0.54 s on never-touched blocks and 0.41 s on resident ones
(`rope_write_kv`, the first writer, 57 -> 4.5 ms). `kv_cache_prefault` makes the whole pool
resident at start; `KVWarmer` instead keeps a window of the free queue's first blocks (the
ones `BlockPool.allocate` takes next) resident, a slice at a time between steps, so the
resident set grows by about the window beyond what the engine has used.

One block's bytes are `num_layers x 2` runs, one per (layer, K|V) region of the cache:

    kv_cache [L, 2, num_blocks, block_size, H_kv, D]: block b of region (l, kv) is
    kv_cache[l, kv, b], block_bytes contiguous bytes at region_base(l, kv) + b * block_bytes
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from plait.engine.block_pool import BlockPool
from plait.engine.config import EngineConfig
from plait.engine.host_memory import populate_writable

logger = logging.getLogger("plait.engine")

RUN_BLOCKS = 4  # the most consecutive blocks one populate call per region covers
SLICE_SECONDS = 0.01  # one `step` stops starting runs after this long


class KVWarmer:
    """Makes resident, at idle, the pages of the first `window_blocks` blocks of `pool`'s
    free queue in `kv_cache` (a CPU tensor of the module docstring's shape). A block once
    warmed stays warm (anonymous memory is not given back); blocks the engine wrote without
    being warmed here are populated again when they reach the window, which costs a page
    walk, not a fault. Contents are never changed. `populate(address, length) -> bool` is
    `host_memory.populate_writable` unless a test passes its own."""

    def __init__(self, kv_cache: torch.Tensor, pool: BlockPool, window_blocks: int,
                 populate: Callable[[int, int], bool] = populate_writable) -> None:
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError("KVWarmer needs the contiguous CPU KV cache")
        layers, kv, num_blocks = kv_cache.shape[:3]
        if num_blocks != pool.num_blocks:
            raise ValueError(f"the cache holds {num_blocks} blocks, the pool {pool.num_blocks}")
        self.pool, self.populate = pool, populate
        self.window = min(window_blocks, num_blocks)
        self.block_bytes = kv_cache[0, 0, 0].nbytes
        region_bytes = num_blocks * self.block_bytes
        self.regions = [kv_cache.data_ptr() + r * region_bytes for r in range(layers * kv)]
        self.warm = bytearray(num_blocks)  # 1: every region's pages of the block resident
        self.enabled = self.window > 0

    def pending(self) -> list[int]:
        """The window's blocks not yet warmed, in the free queue's order."""
        out = []
        for seen, block in enumerate(self.pool.free_queue):
            if seen >= self.window:
                break
            if not self.warm[block.block_id]:
                out.append(block.block_id)
        return out

    def step(self, budget_s: float = SLICE_SECONDS) -> bool:
        """Warm the window's pending blocks, in runs of up to RUN_BLOCKS consecutive ids,
        until `budget_s` has passed (a run once started is finished). True while blocks of
        the window remain to be warmed; False when none do, or when the kernel refuses
        (warming is then off for good, logged once)."""
        if not self.enabled:
            return False
        todo = sorted(self.pending())
        start = time.perf_counter()
        while todo:
            first, count = todo[0], 1
            while count < min(RUN_BLOCKS, len(todo)) and todo[count] == first + count:
                count += 1
            offset, length = first * self.block_bytes, count * self.block_bytes
            if not all(self.populate(base + offset, length) for base in self.regions):
                logger.info("the kernel refused MADV_POPULATE_WRITE; the KV cache is not "
                            "warmed at idle (its pages fault in as written)")
                self.enabled = False
                return False
            self.warm[first:first + count] = b"\x01" * count
            del todo[:count]
            if time.perf_counter() - start >= budget_s:
                break
        return bool(todo)


def kv_warmer(config: EngineConfig, kv_cache: torch.Tensor | None,
              pool: BlockPool) -> KVWarmer | None:
    """The idle-time warmer of a lazily resident CPU cache (a window of
    `kv_cache_warm_tokens`), or None: no cache here (a test's runner), a CUDA cache, a
    prefaulted one, or a window of 0 tokens (the default)."""
    if kv_cache is None or kv_cache.device.type != "cpu" or config.kv_cache_prefault:
        return None
    window = -(-config.kv_cache_warm_tokens // config.block_size)
    return KVWarmer(kv_cache, pool, window) if window > 0 else None


__all__ = ["RUN_BLOCKS", "SLICE_SECONDS", "KVWarmer", "kv_warmer"]
