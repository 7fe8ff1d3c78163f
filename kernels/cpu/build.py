"""Build and load Plait's native CPU kernels (`*.c`, `vec.h` in this folder).

The C sources ship inside the package. The first `library()` call of a process compiles them
with the machine's C compiler (`$CC`, else `cc`) for this CPU (`-march=native`) into one
library in `$PLAIT_CACHE/native/` (default `~/.cache/plait/native/`), keyed by the sources,
the compiler, the flags and the CPU's feature flags; later processes load the cached file.
The OpenMP loops link against the `libgomp` torch loads, so they share torch's runtime and
its `torch.set_num_threads`.

Without a compiler, on a CPU other than x86-64, or with torch built against another OpenMP
runtime, `library()` returns None (the reason is logged once) and the engine runs its
plain-torch / BLAS ops instead (`plait.kernels.ops`). Whether the engine uses the kernels at
all is `EngineConfig.native`, decided once when the ops table is chosen.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("plait.kernels")

_HERE = Path(__file__).parent
# The C sources, built together into one library, and the header they share.
SOURCES = tuple(_HERE / name for name in ("gemm.c", "attention.c", "rowwise.c", "decoder.c"))
HEADER = _HERE / "vec.h"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")

_c_long, _c_float, _ptr = ctypes.c_long, ctypes.c_float, ctypes.c_void_p


def _cache_dir() -> Path:
    return Path(os.environ.get("PLAIT_CACHE", Path.home() / ".cache" / "plait")) / "native"


def _torch_gomp() -> Path | None:
    """The OpenMP runtime torch loaded (its wheel ships `torch/lib/libgomp.so.1`)."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler_version(cc: str) -> str | None:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _build(cc: str, gomp: Path, target: Path) -> str | None:
    """Compile the source into `target` (atomically); returns an error text or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [cc, *FLAGS, "-o", tmp, *map(str, SOURCES), f"-L{gomp.parent}",
           f"-Wl,-rpath,{gomp.parent}", "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(cmd)} failed: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.plait_lanes.restype = ctypes.c_int
    lib.plait_gemm.restype = ctypes.c_int
    lib.plait_gemm.argtypes = [_ptr, _c_long, _c_long, _ptr, _c_long, _c_long, _ptr, _ptr,
                               _c_long]
    lib.plait_decode_attention.restype = ctypes.c_int
    lib.plait_decode_attention.argtypes = [
        _ptr, _c_long, _ptr, _ptr, _c_long, _c_long, _c_long, _c_long, _ptr, _c_long, _c_long,
        _ptr, _ptr, _ptr, _ptr, _ptr, _c_float, _ptr, _ptr]
    lib.plait_rope_write_kv.restype = ctypes.c_int
    lib.plait_rope_write_kv.argtypes = [
        _ptr, _c_long, _ptr, _c_long, _ptr, _c_long, _c_long, _c_long, _c_long, _c_long, _ptr,
        _ptr, _ptr, _ptr, _ptr]
    lib.plait_add_rms_norm.restype = ctypes.c_int
    lib.plait_add_rms_norm.argtypes = [_ptr, _c_long, _ptr, _c_long, _ptr, _c_long, _c_long,
                                       _c_float, _ptr, _ptr]
    lib.plait_silu_mul.restype = ctypes.c_int
    lib.plait_silu_mul.argtypes = [_ptr, _c_long, _c_long, _c_long, _ptr]
    lib.plait_decoder_stack.restype = ctypes.c_int
    lib.plait_decoder_stack.argtypes = [
        _c_long, _ptr, _c_long, _c_long, _c_long, _c_long, _c_long, _c_long, _c_float, _ptr,
        _ptr, _ptr, _ptr, _ptr, _c_long, _ptr, _c_long, _c_long, _ptr, _ptr, _ptr, _ptr, _ptr,
        _c_float, _ptr]
    lib.plait_sample_inverse_cdf.restype = ctypes.c_int
    lib.plait_sample_inverse_cdf.argtypes = [_ptr, _c_long, _c_long, _c_long, _ptr, _ptr, _ptr]
    return lib


def _why_unavailable() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not built for {platform.machine()} (x86-64 only)"
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when unavailable (logged)."""
    why = _why_unavailable()
    gomp = _torch_gomp()
    cc = os.environ.get("CC", "cc")
    version = None
    if why is None and gomp is None:
        why = "torch ships no libgomp (another OpenMP runtime)"
    if why is None:
        version = _compiler_version(cc)
        if version is None:
            why = f"no working C compiler ({cc!r})"
    if why is None:
        key = hashlib.sha256("\0".join([
            *(path.read_text() for path in (HEADER, *SOURCES)), cc, version or "",
            " ".join(FLAGS), _cpu_flags(), str(gomp),
        ]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"plait_cpu_ops-{key}.so"
        if not target.exists():
            why = _build(cc, gomp, target)
        if why is None:
            try:
                return _declare(ctypes.CDLL(str(target)))
            except OSError as exc:
                why = f"loading {target} failed: {exc}"
    logger.warning("native CPU kernels off (%s): plain torch / BLAS paths instead", why)
    return None


def available() -> bool:
    """Whether the kernels build and load on this machine (built on the first call)."""
    return library() is not None


def loaded() -> ctypes.CDLL:
    """`library()`, or RuntimeError when the kernels are not available."""
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available")
    return lib


__all__ = ["FLAGS", "HEADER", "SOURCES", "available", "library", "loaded"]
