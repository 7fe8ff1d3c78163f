"""Other builds of the native CPU kernels than the one the package loads.

    library_without_avx512bf16(tmp_path)   the sources built with -mno-avx512bf16, declared
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from plait.kernels.cpu import build


def library_without_avx512bf16(tmp_path: Path) -> ctypes.CDLL:
    """The kernels compiled as `build` compiles them plus `-mno-avx512bf16` (the bf16 paths'
    fallbacks), loaded with every function declared. Skips the test where torch brings no
    libgomp to link, or where the CPU has no avx512_bf16 (the normal build is then this one)."""
    gomp = build._torch_gomp()
    if gomp is None or "avx512_bf16" not in build._cpu_flags():
        pytest.skip("no libgomp from torch, or a CPU whose native build has no bf16 anyway")
    target = tmp_path / "no_bf16.so"
    subprocess.run([os.environ.get("CC", "cc"), *build.FLAGS, "-mno-avx512bf16", "-o",
                    str(target), *map(str, build.SOURCES), f"-L{gomp.parent}",
                    f"-Wl,-rpath,{gomp.parent}", "-lm"], check=True, capture_output=True,
                   timeout=300)
    return build._declare(ctypes.CDLL(str(target)))
