"""CPU tensors in anonymous mappings of their own, on 2 MiB boundaries, and the repacked
weights' storage on transparent huge pages.

A one-row decode step streams every weight once. From ordinary 4 KiB pages that is a TLB
miss, and a stop of the hardware prefetcher at a page boundary, every 4 KiB; a 2 MiB page
covers 512 of them. Where the system's setting is `madvise` (the usual default) only
memory that asks with MADV_HUGEPAGE gets huge pages. torch's CPU allocator (glibc's heap,
under the engine's 32 MiB mmap threshold) does not ask; numpy asks for its own arrays of
4 MiB and more, and glibc later hands those heap ranges to torch. So from torch the
weights' share on huge pages was left to the load's allocation history: 98 MB to 1 GB of
the 1.5B's repacked weights between processes of one build, and its one-stream decode in
process 24.0 tok/s with 100 MB against 27.1 with the arena (BENCHMARKS.md, "Repacked
weights on transparent huge pages").

    aligned_mapping(nbytes)   zeroed uint8 [nbytes] from a 2 MiB boundary, nothing resident
    madvise(address, length, advice)   the system call; False where refused
    weight_storage(nbytes)    uint8 [nbytes], 64-byte aligned, from WEIGHTS (a HugePageArena)
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import torch

from plait.engine.libc import libc_function

# madvise(2) advice (linux/mman.h): transparent huge pages, or none; fault every page in,
# writable (Linux 5.14+); and the huge page size (x86-64).
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_WRITE = 23
HUGE_PAGE = 2 << 20


def madvise(address: int, length: int, advice: int) -> bool:
    """madvise(address, length, advice); False where the C library or the kernel refuses
    (not Linux, transparent huge pages compiled out, a kernel older than the advice)."""
    function = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    return function is not None and function(address, length, advice) == 0


def aligned_mapping(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], zeroed, starting on a 2 MiB boundary of a private anonymous mapping
    of its own (up to 2 MiB longer); nothing of it is resident until written. The tensor
    keeps the mapping alive."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset:offset + nbytes]


class HugePageArena:
    """Hands out long-lived uint8 tensors from chunks of `chunk_bytes` that ask for
    transparent huge pages (MADV_HUGEPAGE) before anything touches them, so the kernel backs
    them with 2 MiB pages where it can (4 KiB ones where it cannot: nothing fails).

    Small tensors share a chunk, so a model of many small weights (SmolLM2's are under
    2 MiB each) still lies on huge pages. A request that does not fit the chunk's rest opens
    a new chunk, or, from half a chunk up, a mapping of its own. A chunk's memory is freed
    when the arena has moved on and every tensor in it is gone; the arena keeps only its
    current chunk. What is resident beyond the tensors' bytes: at most the rest of the
    2 MiB page each chunk, or mapping of its own, was last written in. Thread-safe."""

    def __init__(self, chunk_bytes: int = 128 << 20, align: int = 64) -> None:
        if chunk_bytes % HUGE_PAGE or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive multiple of {HUGE_PAGE}")
        self.chunk_bytes, self.align = chunk_bytes, align
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    @staticmethod
    def _mapping(nbytes: int) -> torch.Tensor:
        region = aligned_mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        madvise(region.data_ptr(), region.numel(), MADV_HUGEPAGE)  # refused: 4 KiB pages
        return region

    def empty(self, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes], zeroed, starting on an `align`-byte boundary (no byte is handed
        out twice)."""
        if nbytes >= self.chunk_bytes // 2:
            return self._mapping(nbytes)[:nbytes]
        with self._lock:
            start = -(-self._used // self.align) * self.align
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk, start = self._mapping(self.chunk_bytes), 0
            self._used = start + nbytes
            return self._chunk[start:start + nbytes]


WEIGHTS = HugePageArena()


def weight_storage(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], 64-byte aligned, on huge pages where the kernel gives them: storage
    for a weight kept for the model's life (`WEIGHTS.empty`)."""
    return WEIGHTS.empty(nbytes)
