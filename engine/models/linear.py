"""Float32 GEMMs on CPU: each Linear's weight reordered once, at load, for a fast BLAS path.

Two packings, chosen per process (`prepack_cpu_linears`, env `PLAIT_CPU_GEMM`):

* `mkl` (the default on Intel CPUs where torch has MKL): `cblas_sgemm_pack` of the weight;
  the product runs through `cblas_sgemm_compute` for any number of rows (the pack's row hint
  only tunes blocking). The plain weight is kept beside it (the LM head shares it with the
  embedding).
* `onednn`: oneDNN's blocked layout (`mkldnn._reorder_linear_weight`); the default on
  other CPUs (measured 1.3-2.3x faster than `F.linear` in an earlier session, on the AMD
  EPYC VM BENCHMARKS.md's header describes) and where MKL is missing (aarch64 builds).

Beside either packing, where the native kernels build (`plait.kernels.native`, not with
`PLAIT_NATIVE=0`), each weight is also kept as column panels for the native skinny GEMM,
which runs every product of at most `NATIVE_MAX_ROWS` rows (the decode steps): it streams
the weights once per step with prefetching, which neither BLAS does at these shapes
(`scripts/bench_gemm.py`, same Xeon, ms per pass over the 30 layers at 1 / 8 / 16 / 24 / 32
rows: native 17 / 20 / 25 / 33 / 40, mkl 18 / 26 / 31 / 34 / 39).

Measured on the default model's 30 layers (`scripts/bench_gemm.py`, 2-core Xeon with
AVX-512, 2 threads, three runs; ms per pass over all 120 projection weights): rows 1 / 16 /
64 / 512: mkl 21-28 / 37-38 / 67 / 388, onednn 25-29 / 35-41 / 85-88 / 432, plain
20-23 / 50-52 / 84-87 / 412.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from plait.kernels import native

PACKINGS = ("mkl", "onednn", "none")

# Row hint given to the MKL pack: as fast as 16 or faster at every row count from 1 to 512.
_MKL_ROW_HINT = 128
# oneDNN's row hint, and the row count below which unpacked weights run as W @ x^T (faster
# than x @ W^T for skinny batches in BLAS).
_SKINNY_ROWS = 32
# Products of at most this many rows run on the native panels (measured fastest up to 24).
NATIVE_MAX_ROWS = 24


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...; "" if
    unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_packing(vendor: str | None = None) -> str:
    """`PLAIT_CPU_GEMM` if set (one of `PACKINGS`); else mkl on Intel CPUs where torch has
    MKL (measured fastest there), onednn elsewhere (measured faster than plain BLAS on an
    AMD EPYC, where MKL was not measured), none without oneDNN."""
    chosen = os.environ.get("PLAIT_CPU_GEMM", "").strip().lower()
    if chosen:
        if chosen not in PACKINGS:
            raise ValueError(f"PLAIT_CPU_GEMM must be one of {', '.join(PACKINGS)}, "
                             f"not {chosen!r}")
        return chosen
    vendor = cpu_vendor() if vendor is None else vendor
    if vendor == "GenuineIntel" and torch.backends.mkl.is_available() \
            and hasattr(torch.ops.mkl, "_mkl_linear"):
        return "mkl"
    if torch.backends.mkldnn.is_available():
        return "onednn"
    return "none"


def prepack_cpu_linears(model: nn.Module, packing: str | None = None) -> str:
    """Pack every float32 CPU Linear weight of `model` for `packing` (default:
    `default_packing()`), and as native panels (`panel_weight`, None without the native
    kernels or with packing "none"); returns the packing used. Call again after the weights
    change."""
    packing = packing or default_packing()
    panels = packing != "none" and native.available()
    for module in model.modules():
        if not (isinstance(module, nn.Linear) and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32):
            continue
        weight = module.weight.detach()
        with torch.no_grad():
            if packing == "mkl":
                module.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(
                    weight, _MKL_ROW_HINT)
            elif packing == "onednn":
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                    weight, _SKINNY_ROWS)
            else:
                module.packed_weight = None
            module.panel_weight = native.pack_weight(weight) if panels else None
    return packing


def packed_linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in] plain weight
    packed: torch.Tensor | None,  # weight packed by `prepack_cpu_linears`, or None
    bias: torch.Tensor | None,  # [out]
    panels: torch.Tensor | None = None,  # [P, in, lanes] `native.pack_weight(weight)`
) -> torch.Tensor:  # [T, out], possibly a transposed view
    """x @ weight^T + bias through the weight's packing (the CPU GEMM of every layer): the
    native panels for at most `NATIVE_MAX_ROWS` rows, else the BLAS packing."""
    if panels is not None and 0 < x.shape[0] <= NATIVE_MAX_ROWS and x.device.type == "cpu":
        return native.gemm(x, panels, weight.shape[0], bias)
    if packed is not None and x.device.type == "cpu" and x.shape[0] > 0:
        if packed.shape == weight.shape:  # oneDNN keeps [out, in]; an MKL pack is [size, 1]
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        # rows passed as the pack's batch size: always the packed kernel, never a fallback
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
    if x.device.type != "cpu" or x.shape[0] > _SKINNY_ROWS:
        return nn.functional.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t()
    return out if bias is None else out + bias


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
    """`layer(x)` through its packed weight where it has one."""
    return packed_linear(x, layer.weight, getattr(layer, "packed_weight", None), layer.bias,
                         getattr(layer, "panel_weight", None))


__all__ = ["NATIVE_MAX_ROWS", "PACKINGS", "cpu_vendor", "default_packing", "linear",
           "packed_linear", "prepack_cpu_linears"]
