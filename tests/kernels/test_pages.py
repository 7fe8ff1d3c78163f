"""kernels/cpu/pages.py: 2 MiB-aligned mappings, and the arena that keeps the repacked
weights on memory asking for transparent huge pages. What the kernel then backs it with
depends on the system (its THP setting, free 2 MiB pages), so the tests read what the
process asked for: the mapping's `hg` flag (MADV_HUGEPAGE) in /proc/self/smaps."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from helpers.pages import resident_pages
from helpers.quant_cases import random_weight

from plait.kernels.cpu import build, pages, quant, repack

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
MIB = 1 << 20


def _mapping_of(address: int) -> tuple[int, int, set[str]] | None:
    """(start, end, VmFlags) of this process's mapping holding `address`, or None."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        span = line.split()[0]
        if "-" not in span or ":" in span:  # a field line, not a mapping's header
            continue
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            flags = next(rest for rest in lines[i + 1:] if rest.startswith("VmFlags:"))
            return low, high, set(flags.split()[1:])
    return None


def test_an_aligned_mapping_starts_on_a_huge_page_and_is_not_resident() -> None:
    region = pages.aligned_mapping(3 * MIB + 5)
    assert region.dtype == torch.uint8 and region.numel() == 3 * MIB + 5
    assert region.data_ptr() % pages.HUGE_PAGE == 0
    assert not any(resident_pages(region.data_ptr(), region.numel()))
    assert not region.any()
    region[-1] = 7  # writable to its last byte
    assert int(region[-1]) == 7


def test_small_requests_share_a_chunk_on_64_byte_boundaries() -> None:
    arena = pages.HugePageArena(chunk_bytes=4 * MIB)
    a, b, c = arena.empty(100), arena.empty(64), arena.empty(1)
    assert a.data_ptr() % pages.HUGE_PAGE == 0  # a fresh chunk's start
    assert b.data_ptr() == a.data_ptr() + 128 and c.data_ptr() == b.data_ptr() + 64
    assert [t.numel() for t in (a, b, c)] == [100, 64, 1]
    assert not torch.cat([a, b, c]).any()
    a.fill_(1)
    assert not b.any()  # no overlap


def test_a_request_past_the_chunks_rest_opens_a_new_chunk() -> None:
    """Chunks of 4 MiB: 1.5 + 1.5 MiB fit one; a third 1.5 MiB opens the next, and the
    next small request follows it there."""
    arena = pages.HugePageArena(chunk_bytes=4 * MIB)
    first, second, third = (arena.empty(3 * MIB // 2) for _ in range(3))
    assert second.data_ptr() == first.data_ptr() + 3 * MIB // 2
    assert third.data_ptr() % pages.HUGE_PAGE == 0
    assert not first.data_ptr() <= third.data_ptr() < first.data_ptr() + 4 * MIB
    assert arena.empty(10).data_ptr() == third.data_ptr() + 3 * MIB // 2


def test_a_large_request_gets_a_mapping_of_its_own() -> None:
    """From half a chunk up: its own mapping, and the current chunk goes on where it was."""
    arena = pages.HugePageArena(chunk_bytes=4 * MIB)
    small = arena.empty(1000)
    large = arena.empty(2 * MIB)
    assert large.numel() == 2 * MIB and large.data_ptr() % pages.HUGE_PAGE == 0
    assert arena.empty(8).data_ptr() == small.data_ptr() + 1024


def test_chunk_size_must_be_whole_huge_pages() -> None:
    for bad in (0, MIB, 3 * MIB):
        with pytest.raises(ValueError, match="multiple of"):
            pages.HugePageArena(chunk_bytes=bad)


@linux
def test_chunks_ask_for_huge_pages_and_go_when_unused() -> None:
    """Both a shared chunk and a mapping of its own carry MADV_HUGEPAGE (`hg`); a chunk the
    arena has left is unmapped once its last tensor is gone."""
    arena = pages.HugePageArena(chunk_bytes=4 * MIB)
    small, large = arena.empty(4096), arena.empty(3 * MIB)
    for tensor in (small, large):
        found = _mapping_of(tensor.data_ptr())
        assert found is not None and "hg" in found[2]
    address = small.data_ptr()
    for _ in range(3):  # 4 KiB + 3 x 1.5 MiB: the third opens a new chunk
        arena.empty(3 * MIB // 2)
    del small
    gc.collect()
    assert _mapping_of(address) is None


@linux
@pytest.mark.skipif(not build.available(), reason="native kernels not built")
def test_repacked_weights_lie_in_the_huge_page_arena() -> None:
    """A repacked weight's tiles come from `pages.WEIGHTS`: on memory asking for huge
    pages, 64-byte aligned, and still the product's bits (its embedding rows)."""
    weight = random_weight((quant.Q4_K, quant.Q8_0), (48, 16), 512, seed=3)
    packed = repack.repack(weight)
    found = _mapping_of(packed.data.data_ptr())
    assert found is not None and "hg" in found[2]
    assert packed.data.data_ptr() % 64 == 0
    assert found[0] <= packed.data.data_ptr() + packed.nbytes <= found[1]
    assert torch.equal(repack.repack_dequantize(packed), quant.dequantize_reference(weight))
