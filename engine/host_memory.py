"""Keep freed host memory mapped, so a step's large temporaries do not page-fault.

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
import ctypes.util
import logging

import torch

from plait.engine.sampler import Sampler, SamplingMetadata
from plait.engine.sampling_params import SamplingParams

logger = logging.getLogger("plait.engine")

# glibc's mallopt parameters (malloc.h) and its largest accepted mmap threshold (64-bit).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20


def keep_freed_memory_mapped() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring).
    Returns False, changing nothing, where the C library has no `mallopt` (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # a trim threshold of -1: never trim
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, -1)):
        logger.warning("mallopt refused the thresholds; large temporaries may page-fault")
        return False
    return True


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


__all__ = ["keep_freed_memory_mapped", "warm_sampler"]
