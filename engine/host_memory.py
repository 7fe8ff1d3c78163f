"""Host memory for the CPU engine: keep freed memory mapped, so a step's large temporaries
do not page-fault, and map the KV cache so that its pages become resident as it is used.

glibc serves an allocation above its mmap threshold (128 KiB at start, raised only as such
blocks are freed) with a fresh `mmap`, and returns freed heap tops to the OS past its trim
threshold: either way the next step's logits, softmax and activation temporaries (3-25 MB
each) land on unmapped pages and pay a page fault per 4 KiB touched. Measured on the default
model (BENCHMARKS.md): sampling 100 rows of 49152 logits took 143 ms, 37 ms of it in one
`exp`; with the thresholds below it falls out of the profile. The cost is a resident set at
its high-water mark: freed blocks stay mapped for reuse, as with tcmalloc, which vLLM's CPU
backend preloads for the same reason.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import time
from collections.abc import Callable

import torch

from plait.engine.libc import libc_function, release_free_heap
from plait.engine.sampler import Sampler, SamplingMetadata
from plait.engine.sampling_params import SamplingParams
from plait.kernels.cpu.pages import (
    HUGE_PAGE,
    MADV_HUGEPAGE,
    MADV_NOHUGEPAGE,
    MADV_POPULATE_WRITE,
    aligned_mapping,
    madvise,
)

logger = logging.getLogger("plait.engine")

# glibc's mallopt parameters (malloc.h) and its largest accepted mmap threshold (64-bit).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20


def keep_freed_memory_mapped() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring).
    Returns False, changing nothing, where the C library has no `mallopt` (not glibc)."""
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        return False
    # a trim threshold of -1: never trim
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, -1)):
        logger.warning("mallopt refused the thresholds; large temporaries may page-fault")
        return False
    return True


def populate_writable(address: int, length: int) -> bool:
    """Make the pages of [address, address + length) resident and writable now (Linux
    MADV_POPULATE_WRITE, 5.14+), without changing their contents: what a first write would
    fault in, paid here instead. The range is widened to whole pages. False where the
    kernel or the C library refuses (nothing is touched then)."""
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    end = -(-(address + length) // mmap.PAGESIZE) * mmap.PAGESIZE
    return end == start or madvise(start, end - start, MADV_POPULATE_WRITE)


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype,
             prefault: bool = False) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU for the KV cache, starting on a 2 MiB
    boundary, in a private anonymous mapping of its own.

    The kernel hands out an anonymous mapping zeroed, so by default nothing writes it here:
    a 4 KiB page of the cache becomes resident when K/V is first written to it, and the
    process's resident memory grows with the blocks the engine has used, not with the
    pool's size. That first write pays a page fault inside a step. Transparent huge pages
    are declined then (MADV_NOHUGEPAGE, whatever the system's setting): with them a first
    write makes 2 MiB of each (layer, K|V) region resident at once, and on a VM whose host
    backs guest memory lazily a fresh 2 MiB page is slow (about 10 ms), where 4 KiB faults
    mostly land on guest pages the host already backs. Measured on the benchmark VM (16
    fresh 523-token prompts x 128 tokens of the default model in bf16, in-process,
    docs/bench/history.md "KV pages of 4 KiB"): `rope_write_kv`, where the first writes
    happen, 1.16-1.28 s with huge pages, 0.13 s without; the attention's time did not
    change.

    `prefault` faults every page in now instead (MADV_POPULATE_WRITE, else writing zeros),
    as vLLM and llama.cpp reserve their caches: the whole pool is resident from the start.
    Only then are huge pages asked for (the setting `madvise`, the usual default, gives them
    only to memory that asks), before the first touch: they cost no fault inside a step
    there and spare the attention's scattered block reads TLB misses.

    A view of a mapping up to 2 MiB longer; the tensor keeps the mapping alive."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    region = aligned_mapping(nbytes)
    start = region.data_ptr()
    out = region.view(dtype).view(shape)
    length = nbytes // HUGE_PAGE * HUGE_PAGE
    if not prefault:
        if length:  # 4 KiB pages even where the system's setting is `always`
            madvise(start, length, MADV_NOHUGEPAGE)
        return out
    if length and not madvise(start, length, MADV_HUGEPAGE):
        logger.info("transparent huge pages refused for the KV cache; ordinary pages")
    # the whole pages the tensor spans (the mapping extends at least 2 MiB past `start`)
    span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if not madvise(start, span, MADV_POPULATE_WRITE):
        out.view(torch.uint8).view(-1)[::mmap.PAGESIZE].zero_()  # one write per page
    return out


def warm_sampler(sampler: Sampler, vocab_size: int, max_rows: int) -> int:
    """Sample one dummy batch (as many rows as fit under the mmap threshold per [rows,
    vocab] float32 temporary, at most `max_rows`), so the heap already holds, mapped, what
    a first real batch of that size needs: a first n=100 request sampled 100 rows in 227 ms
    before this, ~0 after. Every dummy row draws from one dummy seeded generator, so the
    sampler's own generator (unseeded rows) does not advance. Returns the rows sampled."""
    rows = max(1, min(max_rows, MMAP_THRESHOLD // (vocab_size * 4)))
    generator = torch.Generator().manual_seed(0)
    meta = SamplingMetadata(
        params=[SamplingParams(temperature=1.0)] * rows, generators=[generator] * rows,
        prompt_token_ids=[[]] * rows, output_token_ids=[[]] * rows, eos_token_ids=())
    sampler(torch.zeros(rows, vocab_size), meta)
    return rows


class IdleHeapRelease:
    """Gives the C heap's free pages back to the OS (`release`, by default
    `release_free_heap`) once the engine has waited idle for `after_s` seconds, at most once
    per idle period and only if it worked since the last release: the decay that jemalloc
    applies to dirty pages (10 s by default), here for the temporaries that
    `keep_freed_memory_mapped` keeps resident for the next step. A burst of requests keeps
    its mapped pages; a server left idle shrinks to its weights, its KV cache's used pages
    and its runtime, and the first step after that pause pays the page faults again.

    The engine loop calls `waiting()` right before it blocks for a command and `working()`
    as soon as it has one; a daemon thread (started here) does the release in between, so a
    step never waits for it. A release that races a command's arrival delays that command
    only by glibc's own locks, and the step it starts may fault back a page just released.
    """

    def __init__(self, after_s: float, release: Callable[[], bool] = release_free_heap) -> None:
        if after_s <= 0:
            raise ValueError(f"after_s must be > 0, got {after_s}")
        self.after_s = after_s
        self.releases = 0  # how many releases ran (read by tests)
        self._release = release
        self._cond = threading.Condition()
        self._idle_since: float | None = None
        self._worked = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="plait-heap-release", daemon=True)
        self._thread.start()

    def waiting(self) -> None:
        """The loop is about to block with nothing to do."""
        with self._cond:
            self._idle_since = time.monotonic()
            self._cond.notify()

    def working(self) -> None:
        """The loop has work again (a command arrived)."""
        with self._cond:
            self._idle_since, self._worked = None, True

    def close(self) -> None:
        """Stop the thread (a release under way finishes first)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._due():
                    since = self._idle_since
                    wait = None if since is None or not self._worked else \
                        since + self.after_s - time.monotonic()
                    self._cond.wait(wait)
                if self._closed:
                    return
                self._worked = False  # this idle period is released; wait for new work
            self._release()  # outside the lock: a command arriving now does not wait
            self.releases += 1

    def _due(self) -> bool:
        since = self._idle_since
        return since is not None and self._worked and time.monotonic() >= since + self.after_s


__all__ = ["HUGE_PAGE", "IdleHeapRelease", "keep_freed_memory_mapped", "kv_zeros",
           "populate_writable", "release_free_heap", "warm_sampler"]
