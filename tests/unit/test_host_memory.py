"""engine/host_memory.py. `keep_freed_memory_mapped`, read back through glibc's own
accounting (`mallinfo2`): with it, a 20 MB block (a step's logits or activation size) comes
from the heap and stays there once freed, for the next step to reuse without page faults;
with glibc's defaults it is a fresh `mmap` each time. Each variant runs in its own
interpreter, since the setting is per process. `warm_sampler`: no side effect on the
sampler's randomness. Both are done by the engine on CPU."""

from __future__ import annotations

import mmap
import textwrap
import time

import pytest
import torch
from helpers.pages import resident_pages
from helpers.paths import run_python

from plait.engine.host_memory import MMAP_THRESHOLD, IdleHeapRelease, warm_sampler
from plait.engine.sampler import Sampler, SamplingMetadata
from plait.engine.sampling_params import SamplingParams

BLOCK = textwrap.dedent("""
    import ctypes
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if FIX:
        from plait.engine.host_memory import keep_freed_memory_mapped
        assert keep_freed_memory_mapped()
    size = 20 << 20
    before = libc.mallinfo2()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    held = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    mmapped = held.hblkhd - before.hblkhd >= size
    kept = after.arena == held.arena > before.arena  # the heap grew for it, kept on free
    print(mmapped, kept)
""")


def _block(fix: bool, cwd) -> list[str]:
    result = run_python(f"FIX = {fix}\n{BLOCK}", cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_a_freed_20mb_block_stays_in_the_heap(tmp_path) -> None:
    # glibc's defaults: mmapped, unmapped again on free
    assert _block(False, tmp_path) == ["True", "False"]
    assert _block(True, tmp_path) == ["False", "True"]


def test_warming_the_sampler_leaves_its_random_stream_alone() -> None:
    """The dummy batch draws from its own generator: unseeded rows sampled afterwards get
    the same tokens as from a sampler that was never warmed."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    meta = SamplingMetadata(params=[SamplingParams(temperature=1.0)] * 6,
                            generators=[None] * 6, prompt_token_ids=[[]] * 6,
                            output_token_ids=[[]] * 6, eos_token_ids=())
    warmed = Sampler(seed=5)
    assert warm_sampler(warmed, vocab_size=300, max_rows=40) == 40
    assert warmed(logits, meta).token_ids == Sampler(seed=5)(logits, meta).token_ids
    # as many rows as fit under the mmap threshold per float32 [rows, vocab] temporary
    assert warm_sampler(Sampler(seed=5), vocab_size=49152, max_rows=256) == \
        MMAP_THRESHOLD // (49152 * 4)


def test_the_engine_does_all_three_on_cpu_in_order(tiny_path, tmp_path) -> None:
    """Keep freed memory mapped, then (the model loaded) give the heap's free pages back,
    then warm the sampler: once each, in that order."""
    code = textwrap.dedent(f"""
        from unittest import mock
        from plait.engine import model_runner
        calls = []
        def spy(name):
            real = getattr(model_runner, name)
            return mock.patch.object(model_runner, name, side_effect=lambda *a, **k: (
                calls.append((name, a[2] if name == "warm_sampler" else None)), real(*a, **k))[1])
        with spy("keep_freed_memory_mapped"), spy("release_free_heap"), spy("warm_sampler"):
            from plait import LLM
            LLM({str(tiny_path)!r}, num_kv_blocks=16, max_num_seqs=8)
        print(calls)
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(
        [("keep_freed_memory_mapped", None), ("release_free_heap", None), ("warm_sampler", 8)])


def test_release_free_heap_returns_what_was_freed(tmp_path) -> None:
    """With the heap never trimmed (`keep_freed_memory_mapped`), 200 MB of freed small
    allocations stay resident until `release_free_heap` gives them back."""
    code = """
from plait.engine.host_memory import keep_freed_memory_mapped, release_free_heap
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
assert keep_freed_memory_mapped()
chunks = [bytearray(64 << 10) for _ in range(3200)]  # 200 MiB in 64 KiB heap blocks
held = rss_mib()
del chunks
freed = rss_mib()
assert release_free_heap()
print(round(held - freed), round(held - rss_mib()))
"""
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    kept_after_free, released = map(int, result.stdout.split()[-2:])
    assert kept_after_free < 20 and released >= 180  # MiB


@pytest.mark.parametrize("prefault", [False, True])
def test_kv_zeros_asks_for_huge_pages_only_when_prefaulting(monkeypatch, prefault) -> None:
    """The KV-cache buffer: zeros of the shape and dtype, starting on a 2 MiB boundary. By
    default its whole 2 MiB pages are declined huge pages (MADV_NOHUGEPAGE) and nothing is
    faulted in; with `prefault` MADV_HUGEPAGE is asked for before MADV_POPULATE_WRITE of
    every 4 KiB page it spans. Refused advice still gives the zeros."""
    from plait.engine import host_memory

    calls = []
    real = host_memory.madvise
    monkeypatch.setattr(host_memory, "madvise",
                        lambda address, length, advice: calls.append((address, length, advice))
                        or real(address, length, advice))
    shape = (3, 2, 100, 16, 3, 64)  # 7.03 MiB float32: 3 whole huge pages
    kv = host_memory.kv_zeros(shape, torch.float32, prefault)
    assert kv.shape == shape and kv.dtype == torch.float32 and kv.is_contiguous()
    assert not kv.any()
    assert kv.data_ptr() % host_memory.HUGE_PAGE == 0
    huge = (kv.data_ptr(), 3 * host_memory.HUGE_PAGE)
    if prefault:
        span = -(-kv.numel() * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
        assert calls == [(*huge, host_memory.MADV_HUGEPAGE),
                         (kv.data_ptr(), span, host_memory.MADV_POPULATE_WRITE)]
    else:
        assert calls == [(*huge, host_memory.MADV_NOHUGEPAGE)]
    monkeypatch.setattr(host_memory, "madvise", lambda address, length, advice: False)
    small = host_memory.kv_zeros((5, 7), torch.bfloat16, prefault)
    assert small.shape == (5, 7) and small.dtype == torch.bfloat16 and not small.any()


def test_a_first_write_makes_one_4k_page_resident() -> None:
    """Without prefault a write to the cache faults in its own 4 KiB page, not the 2 MiB
    around it (which a huge page would), whatever the system's THP setting."""
    from plait.engine import host_memory

    kv = host_memory.kv_zeros((4, 1024, 1024), torch.float32)  # 16 MiB, 8 huge pages
    kv[1, 512, 7] = 1.0
    assert sum(resident_pages(kv.data_ptr(), kv.numel() * 4)) == 1
    assert resident_pages(kv[1, 512].data_ptr(), 4) == [True]


def test_the_kv_cache_is_resident_only_where_written(tmp_path) -> None:
    """1 GiB of cache costs nothing resident until written; writing 64 MiB of it makes
    about that much resident (the engine's cache grows with the blocks it uses)."""
    code = """
import resource, torch
from plait.engine.host_memory import kv_zeros
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
before = rss_mib()
kv = kv_zeros((256, 1024, 1024), torch.float32)  # 1 GiB
allocated = rss_mib()
assert float(kv[255, 1023, 1023]) == 0.0
kv[:16] = 1.0  # 64 MiB written
written = rss_mib()
print(round(allocated - before), round(written - before))
"""
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    allocated, written = map(int, result.stdout.split())
    assert allocated < 16  # MiB: the mapping is not touched
    assert 60 <= written <= 80


@pytest.mark.parametrize("populate", ["madvise", "writes"])
def test_a_prefaulted_kv_cache_is_resident_at_once(tmp_path, populate: str) -> None:
    """`prefault`: the whole 256 MiB mapping is resident before anything is written, and
    still zeros, both through MADV_POPULATE_WRITE and through the per-page writes used where
    the kernel refuses that advice."""
    refuse = ("host_memory.madvise = lambda address, length, advice: "
              "advice == host_memory.MADV_HUGEPAGE" if populate == "writes" else "")
    code = f"""
import pytest
import torch
from plait.engine import host_memory
{refuse}
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
before = rss_mib()
kv = host_memory.kv_zeros((64, 1024, 1024), torch.float32, prefault=True)
allocated = rss_mib()
assert not kv.any()
print(round(allocated - before))
"""
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert 250 <= int(result.stdout.split()[-1]) <= 270  # MiB


@pytest.mark.parametrize("prefault", [False, True])
def test_the_engine_prefaults_its_kv_pool_when_asked(tiny_path, tmp_path, prefault) -> None:
    """`kv_cache_prefault`: the engine's KV mapping is wholly resident once the engine is
    up; by default only what was written is (nothing, before a request and without the
    start-up warm-up)."""
    code = textwrap.dedent(f"""
        from plait import LLM
        llm = LLM({str(tiny_path)!r}, num_kv_blocks=2048, kv_cache_prefault={prefault},
                  warm_up_tokens=0)
        kv = llm.engine.runner.kv_cache
        address = kv.data_ptr()
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            span = line.split()[0]
            if ":" in span:  # a field line, not a mapping's header
                continue
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                rss = next(int(l.split()[1]) for l in lines[i + 1:] if l.startswith("Rss:"))
                print(kv.numel() * kv.element_size() // 1024, rss)
                break
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    pool_kib, resident_kib = map(int, result.stdout.split()[-2:])
    assert pool_kib == 16 * 1024  # 2 layers x K|V x 2048 blocks x 16 tokens x 2 x 16 floats
    if prefault:
        assert pool_kib <= resident_kib <= pool_kib + 2 * 1024 + 4
    else:
        assert resident_kib < 64


IDLE_RELEASE = textwrap.dedent("""
    import ctypes, time
    from plait.engine.host_memory import IdleHeapRelease, keep_freed_memory_mapped
    def anon_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) // 1024
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    assert keep_freed_memory_mapped()
    blocks = [libc.malloc(8 << 20) for _ in range(24)]  # 192 MiB of step temporaries
    for block in blocks:
        ctypes.memset(block, 1, 8 << 20)
    for block in blocks:
        libc.free(block)
    held = anon_mib()
    release = IdleHeapRelease(0.2)
    release.working()
    release.waiting()
    deadline = time.monotonic() + 30
    while release.releases == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    print(release.releases, held - anon_mib())
    release.close()
""")


def test_an_idle_engine_gives_the_kept_temporaries_back(tmp_path) -> None:
    """192 MiB freed under `keep_freed_memory_mapped` stay resident until the engine has
    waited idle for `after_s`; then the release gives them back to the OS."""
    result = run_python(IDLE_RELEASE, tmp_path)
    assert result.returncode == 0, result.stderr
    releases, freed_mib = map(int, result.stdout.split())
    assert releases == 1
    assert freed_mib >= 180


def _wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_the_release_waits_for_a_whole_idle_period_after_work() -> None:
    """No release without work since the last one, none for an idle period cut short by a
    command, exactly one per idle period that lasts `after_s`."""
    calls: list[float] = []
    release = IdleHeapRelease(0.3, release=lambda: calls.append(time.monotonic()) or True)
    try:
        release.waiting()  # idle from the start: nothing was used yet
        time.sleep(0.6)
        assert calls == []
        release.working()
        release.waiting()
        time.sleep(0.05)
        release.working()  # a command came within after_s: that period is not released
        time.sleep(0.6)
        assert calls == []
        idle_at = time.monotonic()
        release.waiting()
        assert _wait_for(lambda: len(calls) == 1)
        assert calls[0] - idle_at >= 0.3
        time.sleep(0.6)  # still idle: no second release for the same period
        assert len(calls) == 1
        release.working()
        release.waiting()
        assert _wait_for(lambda: len(calls) == 2)
        assert release.releases == 2
    finally:
        release.close()


def test_after_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="after_s must be > 0"):
        IdleHeapRelease(0)
