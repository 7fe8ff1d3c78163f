"""Weights repacked once at load at their own bit width (kernels/cpu/repack.c, repack.h).

`repack(weight)` turns a kept `QuantWeight` (GGML blocks, byte for byte as the file holds
them) into a `RepackedWeight`: each part's rows in tiles of 16, the 16 rows' blocks
interleaved so that one AVX-512 register holds 4 codes of each of 16 output columns, the
codes still at 4, 5, 6 or 8 bits, the file's scales beside them. After that the blocks are
no longer read: products go through `repack_gemm` (x quantized to int8 per 32 weights,
exact int32 dot products by vpdpbusd, float32 scales) and embedding rows through
`repack_dequantize` (gguf-py's bits), so the caller can drop the `QuantWeight`.

    type   bytes a weight, file -> repacked
    Q4_0   0.5625 -> 0.5625    Q4_1 0.625 -> 0.625    Q5_0 0.6875 -> 0.6875
    Q8_0   1.0625 -> 1.0625    Q6_K 0.8203 -> 0.8203
    Q4_K   0.5625 -> 0.5781 (6-bit scales kept as bytes)    Q5_K 0.6875 -> 0.7031

plus rows padded to a multiple of 16 (none in the models Plait serves). `REPACKED_TYPES`
are the types this covers; F16 / BF16 parts are not repacked (`repackable`).

The kernel is chosen once per process from the build (`isa()`: AVX512-VNNI with AMX-INT8
tiles for prefill rows where the CPU and Linux allow them and PLAIT_REPACK_AMX=0 is not set,
else AVX512-VNNI where the CPU has it, else plain C); `repack_gemm(..., kernel_isa=ISA_C)`
forces the plain C kernel, `ISA_VNNI512` the VNNI one without AMX: all give the same bits
(the tests compare them).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plait.kernels.cpu.build import ABI, loaded
from plait.kernels.cpu.pages import weight_storage
from plait.kernels.cpu.quant import Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, QuantWeight, type_name

REPACKED_TYPES: frozenset[int] = frozenset({Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K})
ISA_C: int = ABI.constants["PLAIT_REPACK_C"]
ISA_VNNI512: int = ABI.constants["PLAIT_REPACK_VNNI512"]
ISA_AMX: int = ABI.constants["PLAIT_REPACK_AMX"]
ISA_NAMES = {ISA_C: "c", ISA_VNNI512: "avx512-vnni", ISA_AMX: "avx512-vnni+amx"}
# The flag of a descriptor's first word that marks repacked parts (plait_cpu.h's
# PLAIT_QGEMM_REPACKED): `native.qgemm` and the native stack then compute as `repack_gemm`.
REPACKED_FLAG: int = ABI.constants["PLAIT_QGEMM_REPACKED"]
# plait_repack_amx_state's answers (negative: -errno of Linux's refusal)
AMX_ABSENT: int = ABI.constants["PLAIT_AMX_ABSENT"]
AMX_ON: int = ABI.constants["PLAIT_AMX_ON"]
AMX_OFF: int = ABI.constants["PLAIT_AMX_OFF"]
_ALIGN = 64  # each part's tiles start on a cache line


def _check(rc: int, kernel: str) -> None:
    if rc == ABI.constants["PLAIT_ERR_NOMEM"]:
        raise MemoryError(f"native {kernel} could not allocate its buffers")
    if rc != ABI.constants["PLAIT_OK"]:
        raise ValueError(f"{kernel}: shapes or types beyond the kernel's limits")


def isa() -> int:
    """The fastest repacked product of the loaded kernels in this process: ISA_AMX (VNNI,
    AMX-INT8 tiles for prefill rows; not with PLAIT_REPACK_AMX=0 in the environment),
    ISA_VNNI512 or ISA_C. Each includes the ones below it."""
    return int(loaded().plait_repack_isa())


def amx_state() -> int:
    """Why `isa()` is or is not ISA_AMX: AMX_ON, AMX_OFF (PLAIT_REPACK_AMX=0), AMX_ABSENT
    (the build has no AMX-INT8 code: its CPU lacks it), or -errno where Linux refused the
    process the tile state."""
    return int(loaded().plait_repack_amx_state())


def amx_unused() -> str | None:
    """Why a build with the AMX-INT8 prefill rung does not use it in this process, in
    words (the products log says it), or None: it is used, or the build has none."""
    state = amx_state()
    if state == AMX_OFF:
        return "off (PLAIT_REPACK_AMX=0 in the environment)"
    if state < 0:
        return (f"refused by Linux (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(-state)}); "
                "prefill runs the AVX512-VNNI kernels")
    return None


def repackable(weight: QuantWeight) -> bool:
    """Whether `repack` takes `weight`: every part of `REPACKED_TYPES`, K % 32 == 0 (the K
    types' K a whole number of their 256-weight blocks, as `QuantWeight` guarantees)."""
    return weight.in_features % 32 == 0 and all(p.ggml_type in REPACKED_TYPES
                                                for p in weight.parts)


@dataclass(frozen=True, slots=True)
class RepackedWeight:
    """W [out_features, in_features] repacked: `data` holds every part's tiles (part i at
    byte `offsets[i]`, 64-byte aligned); `desc` int64 [1 + 3 parts] = [num_parts |
    REPACKED_FLAG, (address, type, rows) per part] is what the kernels read (the plait_repack
    functions, and plait_qgemm / the native stack, which the flag sends there), valid while
    `data` lives."""

    data: torch.Tensor  # uint8 [nbytes]
    offsets: tuple[int, ...]
    types: tuple[int, ...]
    part_rows: tuple[int, ...]
    in_features: int
    out_features: int
    desc: torch.Tensor  # int64 [1 + 3 * parts]

    @property
    def nbytes(self) -> int:
        """Bytes the repacked weight holds (its tiles and their alignment padding)."""
        return self.data.numel()

    def describe(self) -> str:
        """The part types, e.g. "Q4_K+Q6_K"."""
        return "+".join(type_name(t) for t in self.types)


def repack(weight: QuantWeight) -> RepackedWeight:
    """`weight`'s parts repacked (one pass over its blocks, threaded); the result does not
    reference `weight`'s tensors. ValueError where `repackable(weight)` is False."""
    if not repackable(weight):
        raise ValueError(f"repack: W {weight.describe()} [{weight.out_features}, "
                         f"{weight.in_features}] has a part of a type not repacked, or K % 32")
    lib, k = loaded(), weight.in_features
    sizes = [int(lib.plait_repack_bytes(p.ggml_type, p.rows, k)) for p in weight.parts]
    offsets, total = [], 0
    for size in sizes:
        _check(min(size, 0), "repack")
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    data = weight_storage(total)  # on huge pages where the kernel gives them (pages.py)
    flat: list[int] = [len(weight.parts) | REPACKED_FLAG]
    for part, at in zip(weight.parts, offsets, strict=True):
        _check(lib.plait_repack(part.data.data_ptr(), part.ggml_type, part.rows, k,
                                data.data_ptr() + at), "repack")
        flat += [data.data_ptr() + at, part.ggml_type, part.rows]
    return RepackedWeight(data, tuple(offsets), tuple(p.ggml_type for p in weight.parts),
                          tuple(p.rows for p in weight.parts), k, weight.out_features,
                          torch.tensor(flat, dtype=torch.int64))


def repack_gemm(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    weight: RepackedWeight,  # W [N, K]
    bias: torch.Tensor | None = None,  # [N] float32
    kernel_isa: int | None = None,  # ISA_C, ISA_VNNI512 or ISA_AMX; None: isa()
) -> torch.Tensor:  # [M, N] float32
    """x @ W^T + bias with x quantized to int8 per 32 weights (sx = max |x| / 127, q =
    round(x / sx) to nearest even) and exact int32 dot products with W's codes, float32
    scales and sums: W's values are the file's, x's rounding the only approximation (as
    llama.cpp's CPU path). Any M: W's codes are widened in registers per tile of rows (two
    tiles against up to 4 rows, one against 8 past that); for Q6_K from 24 rows and Q5_0 /
    Q5_K from 128 (prefill) each tile is widened once into a small per-thread scratch that
    all rows then read (repack_wide.h); with ISA_AMX, from 32 or 48 rows by type each
    widened group meets 16 rows at once in an AMX-INT8 tile product (repack_amx.h). All
    with the same bits."""
    return product(x, weight.desc, weight.in_features, weight.out_features, bias, kernel_isa,
                   weight.describe())


def _gemm(kernel: str, fn: Callable[..., int], x: torch.Tensor, desc: torch.Tensor,
          in_features: int, out_features: int, bias: torch.Tensor | None, what: str = "W",
          *extra: int, width: int | None = None) -> torch.Tensor:  # [M, width or N] float32
    """y = fn(x, M, ldx, desc, K, bias, y, width, *extra) for a plait_repack_gemm-shaped C
    product `fn` whose y has `width` columns (default N): x made unit-stride along K and
    bias float32, both checked against W [N, K] (ValueError naming `kernel` otherwise)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    if k != in_features or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"{kernel}: x {tuple(x.shape)} {x.dtype} does not fit W "
                         f"[{out_features}, {in_features}] {what}")
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
        if bias.shape != (out_features,):
            raise ValueError(f"{kernel}: bias {tuple(bias.shape)}, W has {out_features} rows")
    width = out_features if width is None else width
    y = torch.empty(rows, width, dtype=torch.float32)
    if rows == 0:
        return y
    _check(fn(x.data_ptr(), rows, x.stride(0), desc.data_ptr(), k,
              None if bias is None else bias.data_ptr(), y.data_ptr(), width, *extra), kernel)
    return y


def product(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    desc: torch.Tensor,  # int64: a RepackedWeight's desc
    in_features: int,
    out_features: int,
    bias: torch.Tensor | None = None,  # [N] float32
    kernel_isa: int | None = None,
    what: str = "W",
) -> torch.Tensor:  # [M, N] float32
    """`repack_gemm` given the weight's descriptor and shape (what a product row keeps)."""
    return _gemm("repack_gemm", loaded().plait_repack_gemm, x, desc, in_features,
                 out_features, bias, what, _kernel_isa(kernel_isa, "repack_gemm"))


def _kernel_isa(kernel_isa: int | None, kernel: str) -> int:
    """The isa a call of `kernel` asked for (None: `isa()`), or ValueError where this
    build does not have it."""
    chosen = isa() if kernel_isa is None else kernel_isa
    if chosen not in ISA_NAMES or chosen > isa():
        raise ValueError(f"{kernel}: kernel isa {chosen} (this build has up to {isa()})")
    return chosen


@functools.cache
def prompt_bf16() -> bool:
    """Whether `product_bf16` computes in this process: a build with AMX-BF16 whose
    `isa()` is ISA_AMX (so not with PLAIT_REPACK_AMX=0). Asked once: the library asks
    Linux once, and the answer holds for the process."""
    return bool(loaded().plait_repack_prompt_bf16())


def product_bf16(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    desc: torch.Tensor,  # int64: a RepackedWeight's desc
    in_features: int,
    out_features: int,
    bias: torch.Tensor | None = None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    """x W^T + bias with x and W's values rounded to bfloat16 and float32 sums over the
    whole K (AMX-BF16 tiles): the prompt rows' product. Each row's bits depend on that row
    and W only, not on M; they are not `product`'s. Needs `prompt_bf16()`."""
    lib = loaded()
    if not prompt_bf16():
        raise ValueError("repack product_bf16: this build or process has no AMX-BF16 tiles")
    return _gemm("repack product_bf16", lib.plait_repack_gemm_bf16, x, desc, in_features,
                 out_features, bias)


def silu_fusable(desc: torch.Tensor) -> bool:
    """Whether `product_silu` and `product_bf16_silu` take a weight of this descriptor: its
    halves whole tiles (N % 32 == 0) and every part boundary on a multiple of 16 rows."""
    words = desc.tolist()
    bounds = itertools.accumulate(words[3 + 3 * i] for i in range(words[0] & ~REPACKED_FLAG))
    return all(b % 16 == 0 for b in bounds) and sum(words[3::3]) % 32 == 0


def product_silu(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    desc: torch.Tensor,  # int64: a gate | up RepackedWeight's desc, no bias
    in_features: int,
    out_features: int,  # 2 I
    kernel_isa: int | None = None,  # as `repack_gemm`'s
) -> torch.Tensor:  # [M, I] float32
    """silu(gate) * up of `product`'s gate | up product in one pass (per 16 columns the
    gate's tile and the up's tile meet each row; no [M, 2 I] temporary): the same bits as
    `native.silu_mul(product(...))`. Needs `silu_fusable(desc)` (ValueError otherwise)."""
    chosen = _kernel_isa(kernel_isa, "repack product_silu")
    if not silu_fusable(desc):
        raise ValueError("repack product_silu: the gate | up halves are not whole tiles of "
                         "16 rows in one part each")
    return _gemm("repack product_silu", loaded().plait_repack_gemm_silu, x, desc,
                 in_features, out_features, None, "W", chosen, width=out_features // 2)


def product_bf16_silu(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    desc: torch.Tensor,  # int64: a gate | up RepackedWeight's desc, no bias
    in_features: int,
    out_features: int,  # 2 I
) -> torch.Tensor:  # [M, I] float32
    """silu(gate) * up of `product_bf16`'s gate | up product in one pass (each gate tile
    meets the up's tile of the same columns; no [M, 2 I] temporary): the same bits as
    `native.silu_mul(product_bf16(...))`. Needs `prompt_bf16()`, I % 16 == 0 and every 16
    rows of W in one part (ValueError otherwise)."""
    if not prompt_bf16():
        raise ValueError("repack product_bf16_silu: this build or process has no AMX-BF16 "
                         "tiles")
    if out_features % 32:
        raise ValueError(f"repack product_bf16_silu: {out_features} rows, not 2 x a multiple "
                         "of 16")
    return _gemm("repack product_bf16_silu", loaded().plait_repack_gemm_bf16_silu, x, desc,
                 in_features, out_features, None, width=out_features // 2)


def repack_dequantize(
    weight: RepackedWeight,
    rows: torch.Tensor | None = None,  # [R] integer row ids in [0, N); None: all N rows
) -> torch.Tensor:  # [R, K] float32 (R = N without rows)
    """Rows of W in float32 from the repacked tiles: the same bits as gguf-py's dequantizer
    of the original blocks (`quant.dequantize_reference`); the embedding lookup takes
    token ids as rows. ValueError for a row outside [0, N)."""
    return dequantize_rows(weight.desc, weight.in_features, weight.out_features, rows)


def dequantize_rows(
    desc: torch.Tensor,  # int64: a RepackedWeight's desc
    in_features: int,
    out_features: int,
    rows: torch.Tensor | None = None,  # [R] integer row ids in [0, N); None: all N rows
) -> torch.Tensor:  # [R, K] float32
    """`repack_dequantize` given the weight's descriptor and shape (what a product row
    keeps)."""
    lib = loaded()
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    num_rows = out_features if rows is None else rows.shape[0]
    out = torch.empty(num_rows, in_features, dtype=torch.float32)
    if num_rows == 0:
        return out
    _check(lib.plait_repack_dequantize(desc.data_ptr(), in_features,
                                       None if rows is None else rows.data_ptr(), num_rows,
                                       out.data_ptr()), "repack_dequantize")
    return out


__all__ = ["AMX_ABSENT", "AMX_OFF", "AMX_ON", "ISA_AMX", "ISA_C", "ISA_NAMES", "ISA_VNNI512",
           "REPACKED_FLAG", "REPACKED_TYPES", "RepackedWeight", "amx_state", "amx_unused",
           "dequantize_rows", "isa", "product", "product_bf16_silu", "repack",
           "repack_dequantize", "repack_gemm", "repackable", "silu_fusable"]
