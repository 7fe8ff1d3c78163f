"""Which pages of this process's memory are resident: mincore(2) through ctypes.

    resident_pages(address, length)   one bool per page of [address, address + length)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap


def resident_pages(address: int, length: int) -> list[bool]:
    """mincore(2) over the whole pages of [address, address + length)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(address + length - start) // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    if libc.mincore(start, pages * mmap.PAGESIZE, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return [bool(b & 1) for b in vec.raw]
