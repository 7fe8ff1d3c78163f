"""Linear layers, one module per weight format, chosen once at load (`convert_linears`).

The model is built and loaded with `Linear` (torch's [out, in] layout and GEMM, any device).
On CPU the runner then gives every float32 `Linear` the format its ops table names; each
format's module shares the loaded weight Parameter (ties such as the LM head's hold) and
keeps its own copy of it, rebuilt by `prepack()`:

* `MklLinear` ("mkl", the default on Intel CPUs with MKL): `cblas_sgemm_pack`, any rows.
* `OneDnnLinear` ("onednn", the default elsewhere): oneDNN's blocked layout.
* `PanelLinear` (the native kernels on): column panels for the native skinny GEMM, which
  runs every product of at most `NATIVE_MAX_ROWS` rows (decode steps: it streams the
  weights once, with prefetching), over one of the formats above for larger products.

`scripts/bench_gemm.py` measures them side by side (BENCHMARKS.md).

Weights kept in their file's format (engine/gguf_weights.py) load straight into
`QuantLinear` ("gguf": a `QuantWeight` of GGML blocks or raw bf16) and `QuantEmbedding`;
`convert_linears` leaves them as they are.
"""

from __future__ import annotations

from typing import ClassVar, Self

import torch
from torch import nn

from plait.engine.config import CPU_GEMMS
from plait.engine.models.quant_ops import ChunkCache, check_native, matmul_dequantized
from plait.kernels.cpu import native
from plait.kernels.cpu.build import NATIVE_MAX_ROWS
from plait.kernels.cpu.quant import QuantWeight

# Row hint given to the MKL pack: as fast as 16 or faster at every row count from 1 to 512.
_MKL_ROW_HINT = 128
# oneDNN's row hint, and the row count below which plain weights run as W @ x^T on CPU
# (faster than x @ W^T for skinny batches in BLAS).
_SKINNY_ROWS = 32
# The most rows a `QuantLinear` product takes through `qgemm` (blocks decoded in registers
# and L1, weight rows decoded once for all x rows) where the AVX-512 batch kernel is built,
# per compute dtype; more go to `matmul_dequantized` (a dequantized copy, then oneDNN).
# Measured on the 2-core AVX512-BF16 host over every linear weight of a model's layers
# (docs/bench/history.md, "qgemm up to 256 rows"): in bf16 qgemm took 0.34-0.91x the time
# from 24 to 256 rows and broke even at 320-384; in float32 0.69-0.94x up to 128.
QGEMM_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 256}
# The fewest rows a `QuantLinear` product takes through `qgemm_i8` under `use_int8` (below:
# `qgemm`, whose decode in registers costs less than qgemm_i8's packing of every weight row
# for few rows). Measured on the 2-core AVX512-VNNI host over every linear of a model's
# layers, against qgemm in bf16: Qwen2.5-0.5B 1.37x its time at 16 rows, 1.09x at 32, 0.95x
# at 48, 0.87x at 64, 0.70x at 256; SmolLM2 1.31x, 1.06x, 0.93x, 0.86x, 0.71x (against
# qgemm in float32: faster from 16 rows; at 523 rows 0.63-0.66x dequantize + bf16 BLAS).
INT8_MIN_ROWS = 48
# The fewest rows under `use_int8(panels=True)`: with the weights' int8 panels resident
# (`native.qgemm_i8_panels`) there is no packing to amortise, and the panels' plain codes
# cost less to read than the blocks cost to decode even for one row. Measured over all
# kept linears of a model in a step's order (weights cold), against qgemm in bf16:
# Qwen2.5-0.5B 15.2 against 18.1 ms at 1 row, 20.8/27.1 at 2, 37.8/66.5 at 16, 68.9/111.6
# at 32; SmolLM2 6.3/6.7 at 1 row, 13.6/20.5 at 16 (docs/bench/history.md).
INT8_PANEL_MIN_ROWS = 1


def qgemm_max_rows(compute_dtype: torch.dtype) -> int:
    """The most rows a kept weight's product in `compute_dtype` computes through `qgemm`:
    `QGEMM_MAX_ROWS` with the AVX-512 batch kernel (16 lanes), NATIVE_MAX_ROWS without it.
    Needs the native kernels."""
    return QGEMM_MAX_ROWS[compute_dtype] if native.lanes() == 16 else NATIVE_MAX_ROWS


class Linear(nn.Module):
    """y = x @ weight^T + bias, weight [out, in] in torch's layout: torch's GEMM, on any
    device (the "none" format)."""

    format: ClassVar[str] = "none"
    weight: torch.Tensor  # [out, in], an nn.Parameter (a tied head shares the embedding's)
    bias: torch.Tensor | None  # [out]

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def adopt(cls, src: Linear) -> Self:
        """A module of this format over `src`'s weight and bias (the same Parameters),
        prepacked."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = src.in_features, src.out_features
        new.weight, new.bias = src.weight, src.bias
        new.prepack()
        return new

    def prepack(self) -> None:
        """Rebuild this format's copy of `weight` (call again after the weight changes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if x.device.type != "cpu" or x.shape[0] > _SKINNY_ROWS:
            return nn.functional.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.t()).t()  # a transposed view
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format}")


class MklLinear(Linear):
    """The weight packed by MKL (`cblas_sgemm_pack`); float32 CPU."""

    format: ClassVar[str] = "mkl"
    packed: torch.Tensor  # [size, 1] MKL's opaque pack

    def prepack(self) -> None:
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(),
                                                               _MKL_ROW_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        # rows passed as the pack's batch size: always the packed kernel, never a fallback
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, x.shape[0])


class OneDnnLinear(Linear):
    """The weight in oneDNN's blocked layout; float32 CPU."""

    format: ClassVar[str] = "onednn"
    packed: torch.Tensor  # [out, in] in oneDNN's layout

    def prepack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                              _SKINNY_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PanelLinear(Linear):
    """The weight as column panels for the native GEMM (`native.pack_weight`), used for at
    most `NATIVE_MAX_ROWS` rows; `large`, a BLAS format over the same weight, for more.
    The output is always dense (the native row-wise kernels that follow take only that)."""

    format: ClassVar[str] = "panels"
    panels: torch.Tensor  # [P, in, lanes] float32
    large: Linear

    @classmethod
    def over(cls, src: Linear, large: type[Linear]) -> PanelLinear:
        """Panels over `src`'s weight, with `large` (a format class) for large products."""
        new = cls.adopt(src)
        new.large = large.adopt(src)
        return new

    def prepack(self) -> None:
        self.panels = native.pack_weight(self.weight.detach())
        if "large" in self._modules:
            self.large.prepack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= NATIVE_MAX_ROWS:
            return native.gemm(x, self.panels, self.out_features, self.bias)
        return self.large(x).contiguous()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", large={self.large.format}"


class QuantLinear(Linear):
    """y = x @ W^T + bias with W a `QuantWeight` held as the file stores it (float32 CPU
    activations): `qgemm` in `compute_dtype` for at most `qgemm_rows` rows (decode steps and
    short prefills read the blocks once; bf16: x and W rounded to bf16, float32 sums, from
    `quant.BF16_MIN_ROWS` rows); for more rows (prefills) `quant_ops.matmul_dequantized`: W
    dequantized into a process-wide scratch of `compute_dtype` (in row chunks past its cap)
    and multiplied by oneDNN (bf16: bf16 x bf16 with float32 accumulation, output rounded to
    bf16). No float32 copy of W is kept. A tied LM head shares its embedding's weight. The
    native decoder stack reads `descriptor()`, the descriptor `qgemm` is given here.
    `use_int8()` (the engine's `prefill_int8`) sends products of at least `INT8_MIN_ROWS`
    rows to `native.qgemm_i8` instead (x quantized to int8 per group of 32, float32
    output), where the kernel is built and takes every part; `use_int8(panels=True)` keeps
    the weight's int8 panels resident beside its blocks (`i8_panels`, 1.25 bytes a weight)
    and sends products from `INT8_PANEL_MIN_ROWS` rows to them, the native stack's
    included."""

    format: ClassVar[str] = "gguf"
    qweight: QuantWeight

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        nn.Module.__init__(self)
        check_native(qweight)
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.qweight, self.compute_dtype = qweight, compute_dtype
        self.qgemm_rows = qgemm_max_rows(compute_dtype)
        self.register_parameter("weight", None)  # no float copy: `qweight` is the weight
        self.scratch: ChunkCache = {}  # quant_ops.matmul_dequantized's row chunks
        self.int8_rows: int | None = None  # products of this many rows or more: qgemm_i8
        self.i8_panels: torch.Tensor | None = None  # uint8: native.qgemm_i8_panels
        self.i8_desc: torch.Tensor | None = None  # native.i8_descriptor over i8_panels
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(),
                                                           requires_grad=False)

    def use_int8(self, min_rows: int | None = None, panels: bool = False) -> bool:
        """Send products of `min_rows` rows or more (default: `INT8_PANEL_MIN_ROWS` with
        `panels`, else `INT8_MIN_ROWS`) to `native.qgemm_i8`, if it is built and takes this
        weight's parts (else nothing changes); `panels`: from resident int8 panels, packed
        here once. Returns whether it does."""
        if not (native.has_qgemm_i8() and native.qgemm_i8_fits(self.qweight)):
            return False
        if min_rows is None:
            min_rows = INT8_PANEL_MIN_ROWS if panels else INT8_MIN_ROWS
        self.int8_rows = min_rows
        if panels:
            self.i8_panels = native.qgemm_i8_panels(self.qweight)
            self.i8_desc = native.i8_descriptor(self.qweight, self.i8_panels, min_rows,
                                                self.compute_dtype)
        else:
            self.i8_panels = self.i8_desc = None
        return True

    def descriptor(self) -> torch.Tensor:  # int64: what the native stack's qgemm reads
        """The weight's descriptor for `qgemm` as `forward` computes: in `compute_dtype`,
        with the int8 panels and `int8_rows` where `use_int8(panels=True)`."""
        if self.i8_desc is not None:
            return self.i8_desc
        return self.qweight.descriptor(self.compute_dtype)

    def takes_int8(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes through `qgemm_i8`."""
        return self.int8_rows is not None and rows >= self.int8_rows

    def product_int8(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out] float32
        """x @ W^T + bias through `qgemm_i8`, whatever the row count (needs `use_int8`)."""
        return native.qgemm_i8(x.float(), self.qweight, self.bias, desc=self.i8_desc)

    def silu_mul_int8(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / 2]
        """silu(gate) * up of this gate | up weight's product through `qgemm_i8`, fused
        (the bits of `native.silu_mul` of `forward`'s output where `takes_int8`)."""
        return native.qgemm_i8(x.float(), self.qweight, self.bias, silu=True,
                               desc=self.i8_desc)

    def rounds_to_bf16(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes through bf16 BLAS (its input and its output
        rounded to bf16): bf16 compute and more than `qgemm_rows` rows, not int8."""
        return self.compute_dtype == torch.bfloat16 and rows > self.qgemm_rows \
            and not self.takes_int8(rows)

    def forward(self, x: torch.Tensor,  # [T, in] float32 (or bf16 where rounds_to_bf16)
                widen: bool = True) -> torch.Tensor:  # [T, out] float32
        """`widen=False`: where `rounds_to_bf16(T)`, the bf16 product as BLAS rounded it
        (no float32 copy; `matmul_dequantized`); float32 otherwise either way."""
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self.out_features, dtype=torch.float32)
        if self.takes_int8(rows):
            return self.product_int8(x)
        if rows <= self.qgemm_rows:
            return native.qgemm(x.float(), self.qweight, self.bias, self.compute_dtype)
        return matmul_dequantized(x, self.qweight, self.bias, self.compute_dtype, self.scratch,
                                  widen=widen)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", types={self.qweight.describe()}, " \
            f"compute={str(self.compute_dtype).removeprefix('torch.')}"


class QuantEmbedding(nn.Module):
    """Token embeddings kept as a one-part `QuantWeight` [vocab, hidden]: a lookup
    dequantizes just the requested rows."""

    def __init__(self, qweight: QuantWeight) -> None:
        super().__init__()
        check_native(qweight)
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.out_features, qweight.in_features

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] f32
        return native.dequantize(self.qweight, token_ids.to(torch.int64).contiguous())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, types={self.qweight.describe()}"


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(kept, dense): the bytes of `model`'s weights kept in their file's format (each
    `QuantWeight` once), and of the rest: float parameters plus each format's own packed
    copies (panels, MKL/oneDNN packs, `QuantLinear.i8_panels`). Buffers (RoPE tables) are
    not weights."""
    kept: dict[int, int] = {}
    dense: dict[int, int] = {}
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if isinstance(qweight, QuantWeight):
            kept[id(qweight)] = qweight.nbytes
        for name in ("panels", "packed", "i8_panels"):
            copy = module.__dict__.get(name)
            if isinstance(copy, torch.Tensor):
                dense[id(copy)] = copy.numel() * copy.element_size()
    for param in model.parameters():
        dense[id(param)] = param.numel() * param.element_size()
    return sum(kept.values()), sum(dense.values())


def use_prefill_int8(model: nn.Module, panels: bool = False) -> tuple[int, int]:
    """`QuantLinear.use_int8(panels=panels)` on every kept linear of `model`: (how many
    take qgemm_i8, how many kept linears there are). None take it where the kernel is not
    built."""
    kept = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return sum(m.use_int8(panels=panels) for m in kept), len(kept)


FORMATS: dict[str, type[Linear]] = {f.format: f for f in (Linear, MklLinear, OneDnnLinear)}


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


def resolve_cpu_gemm(requested: str = "auto", vendor: str | None = None) -> str:
    """The BLAS format for `requested` (one of `CPU_GEMMS`): itself, or for "auto" mkl on
    Intel CPUs where torch has MKL (measured fastest there), onednn elsewhere (measured
    faster than plain BLAS on an AMD EPYC, where MKL was not measured), none without
    oneDNN."""
    if requested not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm must be one of {', '.join(CPU_GEMMS)}, not {requested!r}")
    if requested != "auto":
        return requested
    vendor = cpu_vendor() if vendor is None else vendor
    if vendor == "GenuineIntel" and torch.backends.mkl.is_available() \
            and hasattr(torch.ops.mkl, "_mkl_linear"):
        return "mkl"
    if torch.backends.mkldnn.is_available():
        return "onednn"
    return "none"


def convert_linears(model: nn.Module, cpu_gemm: str, panels: bool) -> str:
    """Give every float32 CPU `Linear` of `model` its CPU format, in place: `cpu_gemm` (a
    resolved name of `FORMATS`), under native panels when `panels` (which needs the native
    kernels). Returns a description of what was chosen. Other Linears keep torch's GEMM."""
    fmt = FORMATS[cpu_gemm]
    converted, kept, qgemm_rows = 0, set(), set()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantLinear):
                kept.add(child.qweight.describe())
                qgemm_rows.add(child.qgemm_rows)
            if type(child) is not Linear or child.weight.device.type != "cpu" \
                    or child.weight.dtype != torch.float32:
                continue
            setattr(module, name, PanelLinear.over(child, fmt) if panels else fmt.adopt(child))
            converted += 1
    chosen = f"native panels up to {NATIVE_MAX_ROWS} rows, then {cpu_gemm}" if panels \
        else cpu_gemm
    if kept:
        chosen = f"{chosen} ({converted} float32 linears); kept {', '.join(sorted(kept))}: " \
            f"qgemm up to {'/'.join(map(str, sorted(qgemm_rows)))} rows, then dequantized " \
            "per product"
    return chosen


__all__ = ["CPU_GEMMS", "FORMATS", "INT8_MIN_ROWS", "INT8_PANEL_MIN_ROWS", "NATIVE_MAX_ROWS",
           "QGEMM_MAX_ROWS", "Linear", "MklLinear", "OneDnnLinear", "PanelLinear",
           "QuantEmbedding", "QuantLinear",
           "convert_linears", "cpu_vendor", "qgemm_max_rows", "resolve_cpu_gemm",
           "use_prefill_int8", "weight_bytes"]
