"""Other builds of the native CPU kernels than the one the package loads.

    library_without_avx512bf16(tmp_path)   the sources built with -mno-avx512bf16, declared
    library_without_avx512vnni(tmp_path)   the same with -mno-avx512vnni
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from plait.kernels.cpu import build


def _library_without(tmp_path: Path, feature: str, cpu_flag: str,
                     extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels compiled as `build` compiles them plus `-mno-<feature>` (that feature's
    paths' fallbacks) and `extra` flags, loaded with every function declared. Skips the test
    where torch brings no libgomp to link, or where the CPU has no `cpu_flag` (the normal
    build is then this one)."""
    gomp = build._torch_gomp()
    if gomp is None or cpu_flag not in build._cpu_flags():
        pytest.skip(f"no libgomp from torch, or a CPU whose native build has no {cpu_flag}")
    target = tmp_path / f"no_{feature}.so"
    subprocess.run([os.environ.get("CC", "cc"), *build.FLAGS, f"-mno-{feature}", *extra, "-o",
                    str(target), *map(str, build.SOURCES), f"-L{gomp.parent}",
                    f"-Wl,-rpath,{gomp.parent}", "-lm"], check=True, capture_output=True,
                   timeout=300)
    return build._declare(ctypes.CDLL(str(target)))


def library_without_avx512bf16(tmp_path: Path) -> ctypes.CDLL:
    """The kernels without their AVX512-BF16 paths (see `_library_without`)."""
    return _library_without(tmp_path, "avx512bf16", "avx512_bf16")


def library_without_avx512vnni(tmp_path: Path) -> ctypes.CDLL:
    """The kernels without qgemm_i8 (AVX512-VNNI; see `_library_without`), built at -O0 (4 s
    against 29 at -O3 on the 2-core host): its tests check what it refuses, not speed or
    bits."""
    return _library_without(tmp_path, "avx512vnni", "avx512_vnni", ("-O0",))
