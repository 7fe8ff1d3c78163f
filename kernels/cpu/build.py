"""Build and load Plait's native CPU kernels (`*.c`, `*.h` in this folder).

The C ABI is written once, in `plait_cpu.h`: every exported function and every constant
Python shares with the C. This module parses that header at import (text only, no compiler):
`ABI` holds its prototypes, constants and the decoder stack's pointer order, the constants
Python uses (`MAX_QUERIES`, `MAX_HEAD_DIM`, `MAX_BLOCK`, `NATIVE_MAX_ROWS`,
`STACK_POINTERS`) come from it, and the ctypes signatures of the loaded library are
generated from it. Every source includes the header and is compiled with `-Wall -Werror`,
so a definition that disagrees with its declaration does not build.

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

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("plait.kernels")

_HERE = Path(__file__).parent
# The C sources, built together into one library; the ABI header (parsed here) and the
# vector helpers they include. The cache key hashes all of them.
SOURCES = tuple(_HERE / name for name in ("gemm.c", "qgemm.c", "attention.c", "rowwise.c",
                                             "decoder.c", "repack.c"))
HEADER = _HERE / "plait_cpu.h"
HEADERS = (HEADER, _HERE / "vec.h", _HERE / "quant.h", _HERE / "qgemm_bf16.h",
           _HERE / "qgemm_batch.h", _HERE / "qgemm_batch_bf16.h", _HERE / "attention_bf16.h",
           _HERE / "repack.h", _HERE / "repack_acts.h", _HERE / "repack_vnni.h",
           _HERE / "repack_wide.h", _HERE / "repack_amx.h", _HERE / "repack_amx_bf16.h",
           _HERE / "amx.h", _HERE / "attention_amx.h")
# -Wall -Werror: a warning fails the build; -Wmissing-prototypes: so does a non-static
# function plait_cpu.h does not declare (each definition is checked against its prototype).
# Seconds one compiler process may take (_build); a loaded 2-core machine has needed 300+
# for the whole library in one process.
BUILD_TIMEOUT_S = 900
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-Wall", "-Werror",
         "-Wmissing-prototypes")
# Flags of one source besides FLAGS. attention.c: no a * b + c fused into one FMA unless
# the source says so (its `vfma`): the compiler's choice may differ between two inlined
# copies of one loop, and a row's attention must be the same bits whichever copy ran it
# (a prefill tile's, a decode row's, a draft's verification row's).
SOURCE_FLAGS = {"attention.c": ("-ffp-contract=off",)}


class AbiError(ValueError):
    """`plait_cpu.h` holds something `parse_header` does not read (it never skips text)."""


@dataclass(frozen=True)
class Abi:
    """What `plait_cpu.h` declares. `functions`: name -> (C return type, C parameter types),
    types as written without the names (`long`, `const float *`, ...); `constants`: every
    `#define PLAIT_<NAME> <integer>`; `stack_pointers`: the PLAIT_STACK_<NAME> enumerators
    before PLAIT_STACK_POINTERS, lower case without the prefix, in order."""

    functions: dict[str, tuple[str, tuple[str, ...]]]
    constants: dict[str, int]
    stack_pointers: tuple[str, ...]


# C type -> ctypes type: the few the header may use (any pointer is a c_void_p: the callers
# pass data_ptr() addresses, or None for NULL).
_SCALARS = {"long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float}
_RETURNS = {**_SCALARS, "void": None}
_POINTEES = ("float", "int32_t", "int64_t", "uint16_t", "void")
_PARAM = re.compile(r"(?:(?P<const>const)\s+)?(?P<base>\w+)\s*(?P<ptr>\*)?\s*(?P<name>\w+)")
_PROTOTYPE = re.compile(r"(?P<ret>\w+)\s+(?P<name>plait_\w+)\s*\((?P<params>[^()]*)\)")
_ENUM = re.compile(r"enum\s+\w+\s*\{(?P<body>[^{}]*)\}")
_DEFINE = re.compile(r"#define\s+(?P<name>PLAIT_[A-Z0-9_]+)\s+(?P<value>-?[0-9]+)")
_GUARD = re.compile(r"#(?:ifndef|define)\s+(?P<name>PLAIT_CPU_H)|#endif|#include\s+<\w+\.h>")
_STACK_PREFIX = "PLAIT_STACK_"


def _c_type(param: str, where: str) -> str:
    """The type of one parameter declaration (`const float *x` -> `const float *`)."""
    match = _PARAM.fullmatch(param.strip())
    if match is None:
        raise AbiError(f"{where}: cannot parse the parameter {param.strip()!r}")
    base, ptr, const = match["base"], match["ptr"], match["const"]
    if ptr:
        if base not in _POINTEES:
            raise AbiError(f"{where}: pointer to {base!r} (only {', '.join(_POINTEES)})")
        return f"{'const ' if const else ''}{base} *"
    if const or base not in _SCALARS:
        raise AbiError(f"{where}: parameter type {param.strip()!r} (pass long, int, float or a "
                       "pointer)")
    return base


def parse_header(text: str) -> Abi:
    """The declarations of `plait_cpu.h`'s text, in its strict style (see the header):
    raises AbiError on any line or statement it does not read, so nothing is skipped."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    if "/*" in text or "*/" in text or "//" in text:
        raise AbiError("an unterminated /* comment or a // comment")
    constants: dict[str, int] = {}
    code: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped.startswith("#"):
            code.append(line)
            continue
        if (define := _DEFINE.fullmatch(stripped)) is not None:
            if define["name"] in constants:
                raise AbiError(f"line {number}: {define['name']} defined twice")
            constants[define["name"]] = int(define["value"])
        elif _GUARD.fullmatch(stripped) is None:
            raise AbiError(f"line {number}: cannot parse {stripped!r} (only #define "
                           "PLAIT_<NAME> <integer>, the include guard and #include <...>)")
    functions: dict[str, tuple[str, tuple[str, ...]]] = {}
    stack: tuple[str, ...] | None = None
    statements = " ".join(code).split(";")
    if statements[-1].strip():
        raise AbiError(f"text after the last declaration: {statements[-1].strip()[:80]!r}")
    for statement in (s.strip() for s in statements[:-1]):
        statement = " ".join(statement.split())
        if (proto := _PROTOTYPE.fullmatch(statement)) is not None:
            name, where = proto["name"], proto["name"]
            if proto["ret"] not in _RETURNS:
                raise AbiError(f"{where}: return type {proto['ret']!r}")
            if name in functions:
                raise AbiError(f"{where}: declared twice")
            params = proto["params"].strip()
            types = () if params == "void" else tuple(
                _c_type(param, where) for param in params.split(","))
            functions[name] = (proto["ret"], types)
        elif (enum := _ENUM.fullmatch(statement)) is not None:
            if stack is not None:
                raise AbiError("a second enum (only the PLAIT_STACK_* one)")
            names = [n.strip() for n in enum["body"].split(",")]
            if names and not names[-1]:
                names.pop()  # a trailing comma
            if not names or names[-1] != f"{_STACK_PREFIX}POINTERS" or any(
                    not re.fullmatch(f"{_STACK_PREFIX}[A-Z0-9_]+", n) for n in names):
                raise AbiError(f"cannot parse the enum {statement[:120]!r}: only "
                               f"{_STACK_PREFIX}<NAME> enumerators without values, "
                               f"{_STACK_PREFIX}POINTERS last")
            stack = tuple(n.removeprefix(_STACK_PREFIX).lower() for n in names[:-1])
            if len(set(stack)) != len(stack):
                raise AbiError("an enumerator named twice")
        else:
            raise AbiError(f"cannot parse {statement[:120]!r} (one `int plait_<name>(...)` "
                           "prototype per statement, or the PLAIT_STACK_* enum)")
    if stack is None:
        raise AbiError(f"no enum of {_STACK_PREFIX}* pointers")
    if not functions:
        raise AbiError("no plait_* prototypes")
    return Abi(functions, constants, stack)


ABI = parse_header(HEADER.read_text())


def _constant(name: str) -> int:
    try:
        return ABI.constants[name]
    except KeyError:
        raise AbiError(f"{HEADER.name} does not define {name}") from None


# The limits Python checks before calling (plait_cpu.h).
MAX_QUERIES = _constant("PLAIT_MAX_QUERIES")
MAX_HEAD_DIM = _constant("PLAIT_MAX_HEAD_DIM")
MAX_BLOCK = _constant("PLAIT_MAX_BLOCK")
NATIVE_MAX_ROWS = _constant("PLAIT_NATIVE_MAX_ROWS")
# The pointers of one decoder layer in `plait_decoder_stack`'s table, in order.
STACK_POINTERS = ABI.stack_pointers


def ctypes_signature(name: str) -> tuple[type | None, list[type]]:
    """(restype, argtypes) of function `name`, generated from its prototype in `ABI`."""
    ret, params = ABI.functions[name]
    return _RETURNS[ret], [ctypes.c_void_p if t.endswith("*") else _SCALARS[t] for t in params]


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


@functools.cache
def _compiler_version(cc: str) -> str | None:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _build(cc: str, gomp: Path, target: Path, extra: tuple[str, ...] = ()) -> str | None:
    """Compile the sources into `target` (atomically), with FLAGS and then `extra` (the
    tests' other builds: tests/helpers/native_builds.py); returns an error text or None.
    Each source is compiled to an object file in its own compiler process, up to one per
    CPU at once (repack.c and attention.c take minutes each on a loaded 2-core machine),
    then linked; each process may take BUILD_TIMEOUT_S."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmpdir:
        objects = [Path(tmpdir) / f"{src.stem}.o" for src in SOURCES]
        compile_flags = [flag for flag in (*FLAGS, *extra) if flag != "-shared"]
        jobs = [[cc, *compile_flags, *SOURCE_FLAGS.get(src.name, ()), "-c", "-o", str(obj),
                 str(src)]
                for src, obj in zip(SOURCES, objects, strict=True)]
        tmp = str(Path(tmpdir) / target.name)
        link = [cc, *FLAGS, *extra, "-o", tmp, *map(str, objects), f"-L{gomp.parent}",
                f"-Wl,-rpath,{gomp.parent}", "-lm"]
        with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
            errors = [e for e in pool.map(_run, jobs) if e is not None]
        if errors:
            return errors[0]
        error = _run(link)
        if error is None:
            os.replace(tmp, target)
        return error


def _run(cmd: list[str]) -> str | None:
    """Run one compiler command; an error text naming it, or None."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(cmd)} failed: {exc}"
    if done.returncode != 0:
        return f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}"
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets every exported function's restype / argtypes from its prototype in `ABI`."""
    for name in ABI.functions:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise AbiError(f"{HEADER.name} declares {name}, which {lib._name} does not "
                           "export") from None
        fn.restype, fn.argtypes = ctypes_signature(name)
    return lib


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def build_environment_problem() -> str | None:
    """Why this machine cannot build the kernels at all (not x86-64, torch without libgomp,
    no working C compiler), or None when it can: `library()` is then None only when the
    build or the load failed (`unavailable_reason()`), a bug rather than a missing tool."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not built for {platform.machine()} (x86-64 only)"
    if _torch_gomp() is None:
        return "torch ships no libgomp (another OpenMP runtime)"
    if _compiler_version(_compiler()) is None:
        return f"no working C compiler ({_compiler()!r})"
    return None


_unavailable: list[str] = []  # why library() is None, once it has run


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when unavailable (logged)."""
    why = build_environment_problem()
    if why is None:
        cc, gomp = _compiler(), _torch_gomp()
        assert gomp is not None
        key = hashlib.sha256("\0".join([
            *(path.read_text() for path in (*HEADERS, *SOURCES)), cc,
            _compiler_version(cc) or "", " ".join(FLAGS), repr(sorted(SOURCE_FLAGS.items())),
            _cpu_flags(), str(gomp),
        ]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"plait_cpu_ops-{key}.so"
        if not target.exists():
            why = _build(cc, gomp, target)
        if why is None:
            try:
                return _declare(ctypes.CDLL(str(target)))
            except (OSError, AbiError) as exc:
                why = f"loading {target} failed: {exc}"
    _unavailable.append(why)
    logger.warning("native CPU kernels off (%s): plain torch / BLAS paths instead", why)
    return None


def unavailable_reason() -> str | None:
    """Why `library()` is None (building it first if need be), or None when it loaded."""
    return None if library() is not None else _unavailable[-1]


def available() -> bool:
    """Whether the kernels build and load on this machine (built on the first call)."""
    return library() is not None


def loaded() -> ctypes.CDLL:
    """`library()`, or RuntimeError when the kernels are not available."""
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available")
    return lib


def check_rc(rc: int, kernel: str, limits: str = "") -> None:
    """A kernel's return code (plait_cpu.h: 0 ok, -1 shapes refused, -2 out of memory) as
    an exception."""
    if rc == -2:
        raise MemoryError(f"native {kernel} could not allocate its buffers")
    if rc != 0:
        raise ValueError(f"{kernel}: shapes beyond the kernel's limits{limits}")


__all__ = ["ABI", "FLAGS", "HEADER", "HEADERS", "MAX_BLOCK", "MAX_HEAD_DIM", "MAX_QUERIES",
           "NATIVE_MAX_ROWS", "SOURCES", "STACK_POINTERS", "Abi", "AbiError", "available",
           "build_environment_problem", "check_rc", "ctypes_signature", "library", "loaded",
           "parse_header", "unavailable_reason"]
