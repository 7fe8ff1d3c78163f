"""The C library's functions that Plait calls through ctypes, torch-free (the API process
imports this module too): looked up once, None where the C library lacks them (not glibc,
not Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def libc_function(name: str, argtypes: tuple[Any, ...]) -> Any | None:
    """The C library's function `name` (returning int) via ctypes, or None where the C
    library or the function is missing (not glibc / not Linux). Looked up once."""
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim(0)`), whatever the
    trim threshold. glibc alone returns only a free top of its heap, so what a load frees
    in the middle (GGUF metadata, the tokenizer's JSON parse: 44 MB in the API process for
    Qwen2.5's 151936-token vocabulary; 109 MB in the engine on the default model under
    `host_memory.keep_freed_memory_mapped`) would stay resident for the process's life.
    False where the C library has no `malloc_trim` (not glibc) or nothing could be
    released."""
    malloc_trim = libc_function("malloc_trim", (ctypes.c_size_t,))
    return malloc_trim is not None and malloc_trim(0) == 1


__all__ = ["libc_function", "release_free_heap"]
