"""Other builds of the native CPU kernels than the one the package loads.

    library_without_avx512bf16(tmp_path)   the sources built with -mno-avx512bf16, declared
    library_without_avx512vnni(tmp_path)   the same with -mno-avx512vnni
    library_without_amx(tmp_path)          the same with -mno-amx-tile (no AMX-INT8 either)
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from plait.kernels.cpu import build

_BUILT: dict[tuple[str, ...], ctypes.CDLL] = {}


def _library_without(tmp_path: Path, feature: str, cpu_flag: str,
                     extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels compiled as `build` compiles them (build._build) plus `-mno-<feature>`
    (that feature's paths' fallbacks) and `extra` flags, loaded with every function
    declared; built once per test session and flags, into the first caller's `tmp_path`.
    Skips the test where torch brings no libgomp to link, or where the CPU has no
    `cpu_flag` (the normal build is then this one)."""
    gomp = build._torch_gomp()
    if gomp is None or cpu_flag not in build._cpu_flags():
        pytest.skip(f"no libgomp from torch, or a CPU whose native build has no {cpu_flag}")
    flags = (f"-mno-{feature}", *extra)
    if flags not in _BUILT:
        target = tmp_path / f"no_{feature}.so"
        error = build._build(os.environ.get("CC", "cc"), gomp, target, flags)
        assert error is None, error
        _BUILT[flags] = build._declare(ctypes.CDLL(str(target)))
    return _BUILT[flags]


def library_without_avx512bf16(tmp_path: Path) -> ctypes.CDLL:
    """The kernels without their AVX512-BF16 paths (see `_library_without`)."""
    return _library_without(tmp_path, "avx512bf16", "avx512_bf16")


def library_without_avx512vnni(tmp_path: Path) -> ctypes.CDLL:
    """The kernels without their AVX512-VNNI repacked product (see `_library_without`),
    built at -O0 (seconds, against half a minute at -O3 on the 2-core host): its tests
    check what it reports and refuses, and the plain C product's bits."""
    return _library_without(tmp_path, "avx512vnni", "avx512_vnni", ("-O0",))


def library_without_amx(tmp_path: Path) -> ctypes.CDLL:
    """The kernels without AMX (-mno-amx-tile, which takes AMX-INT8 with it: the repacked
    product's AMX rung is not compiled; see `_library_without`), built at -O0: its test
    checks what it reports and refuses, and the VNNI product's bits."""
    return _library_without(tmp_path, "amx-tile", "amx_tile", ("-O0",))
