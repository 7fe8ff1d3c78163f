"""`keep_freed_memory_mapped` (engine/host_memory.py), read back through glibc's own
accounting (`mallinfo2`): with it, a 20 MB block (a step's logits or activation size) comes
from the heap and stays there once freed, for the next step to reuse without page faults;
with glibc's defaults it is a fresh `mmap` each time. Each variant runs in its own
interpreter, since the setting is per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import ctypes, sys
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "fix":
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


def _block(variant: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", BLOCK, variant], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_a_freed_20mb_block_stays_in_the_heap() -> None:
    assert _block("default") == ["True", "False"]  # glibc's defaults: mmap, unmapped on free
    assert _block("fix") == ["False", "True"]


def test_the_engine_sets_it_on_cpu(tiny_path) -> None:
    code = textwrap.dedent(f"""
        from unittest import mock
        from plait.engine import model_runner
        with mock.patch.object(model_runner, "keep_freed_memory_mapped",
                               wraps=model_runner.keep_freed_memory_mapped) as spy:
            from plait import LLM
            LLM({str(tiny_path)!r}, num_kv_blocks=16)
        print(spy.call_count)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "1"
