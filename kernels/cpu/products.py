"""The product table: every way Plait computes a linear layer's y = x @ W^T + bias, one
frozen row each, chosen once at load (`engine/models/linear.py: select_products`).

A row (`Product`) holds:

    name      what the load log and the tests call it ("kept/f32", "panels/onednn", ...)
    takes     whether the row computes a given weight (its format, its shape, the build)
    prepare   the weight packed once into the row's own layout and its descriptor written:
              a `ProductState`, which the row's kernels (and the native stack) read
    ladder    ((max_rows, kernel), ...): a product of M rows runs the first rung with
              M <= max_rows (None: any M). The rows' thresholds live here or are read from
              plait_cpu.h through build.py (`NATIVE_MAX_ROWS`, `BF16_MIN_ROWS`); inside a
              rung, the dequantized product pads bf16 rows (dequantized.PAD_FROM_ROWS) and
              the C kernels pick their own tiles (qgemm_batch.h's BATCH_MIN_ROWS, ...)
    silu      the fused SiLU kernel: a rung's `silu` computes silu(gate) * up of a gate | up
              weight's product in one go; rungs without one run the row's `silu_mul` on
              the product (`native.silu_mul` for native rows, torch for the others)
    stack     the stack descriptor: what `plait_decoder_stack` reads for this weight (an
              int64 descriptor and the tensors it points into), or None: the row cannot run
              in the native stack, and a model with such a linear runs layer by layer

    row                 ladder (rows -> kernel)
    torch               <= 32: W @ x^T (CPU) | any: F.linear
    mkl / onednn        any: the BLAS pack
    panels/<blas>       <= NATIVE_MAX_ROWS: native.gemm | any: <blas>
    kept/<dtype>        < BF16_MIN_ROWS: qgemm exact | <= QGEMM_MAX_ROWS: qgemm | any: BLAS
                        over W dequantized to <dtype> (float32: the first two are one rung)
    repacked/<isa>      any: repack.product over the weight repacked at load (x int8);
                        within `prompt_rows(True)`, where `repack.prompt_bf16()`,
                        repack.product_bf16 (AMX-BF16 tiles) instead

How to add a row (for example a repacked format): write its `prepare` (pack the weight,
return a `ProductState` whose `packed` holds the new layout and whose `desc` is what your
kernels read), its kernels `(state, x [M, K] float32) -> y [M, N] float32`, and its ladder;
build the `Product` and add it in `_table` below (a new name), and put it in `preference(...)`'s
order for the settings that should choose it (the first row of that order whose `takes`
accepts a weight computes it). A row the native stack cannot read returns None from
`stack`. The tests force a row by name (`row(name)`), so add the row's kernel test there
against the float64 or dequantized reference.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from plait.kernels.cpu import native, repack
from plait.kernels.cpu.build import NATIVE_MAX_ROWS
from plait.kernels.cpu.dequantized import matmul_dequantized
from plait.kernels.cpu.product_row import (
    Kernel,
    Product,
    ProductState,
    Rung,
    StackWeight,
    Weight,
)
from plait.kernels.cpu.quant import BF16_MIN_ROWS, QuantWeight

# ---------------------------------------------------------------- row thresholds
# The most rows the plain torch row multiplies as W @ x^T on CPU (faster than x @ W^T for
# skinny batches in BLAS); also oneDNN's row hint.
SKINNY_ROWS = 32
# Row hint given to the MKL pack: as fast as 16 or faster at every row count from 1 to 512.
MKL_ROW_HINT = 128
# The most rows a kept weight's product takes through `qgemm` (blocks decoded in registers
# and L1, weight rows decoded once for all x rows) where the AVX-512 batch kernel is built,
# per compute dtype; more go to `matmul_dequantized` (a dequantized copy, then oneDNN).
# Measured on the 2-core AVX512-BF16 host over every linear weight of a model's layers
# (docs/bench/history.md, "qgemm up to 256 rows"): in bf16 qgemm took 0.34-0.91x the time
# from 24 to 256 rows and broke even at 320-384; in float32 0.69-0.94x up to 128.
QGEMM_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 256}
# The most bytes of a repacked MLP chunk's [rows, I] float32 silu(gate) * up: under
# host_memory.MMAP_THRESHOLD (32 MiB), so chunks reuse the heap's mapped pages; a chunk
# has at least MLP_CHUNK_MIN_ROWS rows.
MLP_CHUNK_BYTES = 24 << 20
MLP_CHUNK_MIN_ROWS = 48
_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # in row names

# ---------------------------------------------------------------- shared pieces
def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _native_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    return native.silu_mul(gate_up)


def _no_stack(state: ProductState) -> StackWeight | None:
    return None


def _dense(weight: Weight) -> bool:
    return isinstance(weight, torch.Tensor)


def _dense_cpu_f32(weight: Weight) -> bool:
    return isinstance(weight, torch.Tensor) and weight.device.type == "cpu" \
        and weight.dtype == torch.float32


def _dense_state(weight: Weight, bias: torch.Tensor | None,
                 packed: torch.Tensor | None = None,
                 large: ProductState | None = None) -> ProductState:
    assert isinstance(weight, torch.Tensor)
    out_features, in_features = weight.shape
    return ProductState(in_features, out_features, bias, weight=weight, packed=packed,
                        large=large)


def check_native(weight: QuantWeight) -> None:
    """Raise unless the native kernels are here and take every part of `weight` (what a
    kept weight computes through: there is no other path)."""
    missing = sorted({p.ggml_type for p in weight.parts} - native.QUANT_TYPES)
    if not native.available() or missing:
        raise RuntimeError(f"weights kept as {weight.describe()} need the native CPU kernels "
                           "for every part type; load with weights='float32' instead")


def qgemm_max_rows(compute_dtype: torch.dtype) -> int:
    """The most rows a kept weight's product in `compute_dtype` computes through `qgemm`:
    `QGEMM_MAX_ROWS` with the AVX-512 batch kernel (16 lanes), NATIVE_MAX_ROWS without it.
    Needs the native kernels."""
    return QGEMM_MAX_ROWS[compute_dtype] if native.lanes() == 16 else NATIVE_MAX_ROWS


# ---------------------------------------------------------------- dense rows
def _skinny(state: ProductState, x: torch.Tensor) -> torch.Tensor:
    assert state.weight is not None
    if x.device.type != "cpu":
        return nn.functional.linear(x, state.weight, state.bias)
    out = torch.mm(state.weight, x.t()).t()  # a transposed view
    return out if state.bias is None else out + state.bias


def _linear(state: ProductState, x: torch.Tensor) -> torch.Tensor:
    assert state.weight is not None
    return nn.functional.linear(x, state.weight, state.bias)


def _mkl(state: ProductState, x: torch.Tensor) -> torch.Tensor:
    # rows passed as the pack's batch size: always the packed kernel, never a fallback
    return torch.ops.mkl._mkl_linear(x, state.packed, state.weight, state.bias, x.shape[0])


def _onednn(state: ProductState, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, state.packed, state.bias, "none", [], "")


def _prepare_torch(weight: Weight, bias: torch.Tensor | None) -> ProductState:
    return _dense_state(weight, bias)


def _prepare_mkl(weight: Weight, bias: torch.Tensor | None) -> ProductState:
    assert isinstance(weight, torch.Tensor)
    return _dense_state(weight, bias, torch.ops.mkl._mkl_reorder_linear_weight(
        weight.detach(), MKL_ROW_HINT))


def _prepare_onednn(weight: Weight, bias: torch.Tensor | None) -> ProductState:
    assert isinstance(weight, torch.Tensor)
    return _dense_state(weight, bias, torch.ops.mkldnn._reorder_linear_weight(
        weight.detach(), SKINNY_ROWS))


TORCH = Product("torch", _dense, _prepare_torch,
                (Rung(SKINNY_ROWS, _skinny), Rung(None, _linear)), _torch_silu_mul, _no_stack)
MKL = Product("mkl", _dense_cpu_f32, _prepare_mkl, (Rung(None, _mkl),), _torch_silu_mul,
              _no_stack)
ONEDNN = Product("onednn", _dense_cpu_f32, _prepare_onednn, (Rung(None, _onednn),),
                 _torch_silu_mul, _no_stack)
# The BLAS rows by the engine's `cpu_gemm` name.
BLAS: dict[str, Product] = {"none": TORCH, "mkl": MKL, "onednn": ONEDNN}


def _panels_row(large: Product) -> Product:
    """Native float32 panels for at most NATIVE_MAX_ROWS rows (a decode step: the weights
    stream once), `large` (a BLAS row over the same weight) for more; the output is always
    dense (the native row-wise kernels that follow take only that)."""

    def prepare(weight: Weight, bias: torch.Tensor | None) -> ProductState:
        assert isinstance(weight, torch.Tensor)
        return _dense_state(weight, bias, native.pack_weight(weight.detach()),
                            large.prepare(weight, bias))

    def gemm(state: ProductState, x: torch.Tensor) -> torch.Tensor:
        assert state.packed is not None
        return native.gemm(x, state.packed, state.out_features, state.bias)

    def blas(state: ProductState, x: torch.Tensor) -> torch.Tensor:
        assert state.large is not None
        return large(state.large, x).contiguous()

    blas.__name__ = large.name

    def stack(state: ProductState) -> StackWeight | None:
        panels = state.packed
        if panels is None or not panels.is_contiguous():
            return None
        return StackWeight(native.panels_desc(panels, state.out_features), (panels,))

    return Product(f"panels/{large.name}", _dense_cpu_f32, prepare,
                   (Rung(NATIVE_MAX_ROWS, gemm), Rung(None, blas)), _native_silu_mul, stack,
                   native=True)


# ---------------------------------------------------------------- kept rows


def _kept(weight: Weight) -> bool:
    return isinstance(weight, QuantWeight)


def _kept_state(weight: Weight, bias: torch.Tensor | None, desc: torch.Tensor) -> ProductState:
    assert isinstance(weight, QuantWeight)
    return ProductState(weight.in_features, weight.out_features, bias, qweight=weight,
                        desc=desc)


def _kept_stack(state: ProductState) -> StackWeight | None:
    assert state.qweight is not None and state.desc is not None
    return StackWeight(state.desc, tuple(part.data for part in state.qweight.parts))


def _qgemm(compute_dtype: torch.dtype) -> Kernel:
    def qgemm(state: ProductState, x: torch.Tensor) -> torch.Tensor:
        assert state.qweight is not None
        return native.qgemm(x.float(), state.qweight, state.bias, compute_dtype)
    qgemm.__name__ = f"qgemm_{_DTYPE_NAMES[compute_dtype]}"
    return qgemm


def _dequantized(compute_dtype: torch.dtype, widen: bool = True) -> Kernel:
    def dequantized(state: ProductState, x: torch.Tensor) -> torch.Tensor:
        assert state.qweight is not None
        return matmul_dequantized(x, state.qweight, state.bias, compute_dtype, state.scratch,
                                  widen=widen)
    dequantized.__name__ = f"dequantized_{_DTYPE_NAMES[compute_dtype]}"
    return dequantized


def _dequantized_silu(state: ProductState, x: torch.Tensor) -> torch.Tensor:
    """bf16 BLAS: the bf16 product as BLAS rounded it goes to the native silu_mul as it is,
    its bf16 result to the next product of the same row, which rounds its input to bf16
    anyway: the bits of the float32 path without two float32 copies of [T, 2 I], [T, I]."""
    return native.silu_mul(_dequantized(torch.bfloat16, widen=False)(state, x))


def _chunk_rows(state: ProductState, rows: int) -> int | None:
    """Row chunks whose [rows, I] float32 stays below glibc's raised mmap threshold
    (host_memory.py), so each chunk reuses mapped pages instead of faulting in a fresh
    mapping; a row's result does not depend on its chunk. None: one chunk."""
    if state.out_features % 32:
        return None
    most = max(MLP_CHUNK_MIN_ROWS, MLP_CHUNK_BYTES // (2 * state.out_features))
    if rows <= most:
        return None
    return -(-rows // -(-rows // most))  # equal chunks, each at most `most` rows


def _kept_ladder(compute_dtype: torch.dtype) -> tuple[Rung, ...]:
    """qgemm up to `qgemm_max_rows`, then BLAS over W dequantized; bf16: one row stays exact
    (C: the flag's BF16_MIN_ROWS)."""
    most = qgemm_max_rows(compute_dtype)
    rungs: list[Rung] = []
    if compute_dtype == torch.bfloat16:
        rungs.append(Rung(BF16_MIN_ROWS - 1, _qgemm(torch.float32)))
    rungs.append(Rung(most, _qgemm(compute_dtype)))
    rungs.append(Rung(None, _dequantized(compute_dtype), silu=_dequantized_silu
                      if compute_dtype == torch.bfloat16 else None))
    return tuple(rungs)


def _kept_row(compute_dtype: torch.dtype) -> Product:
    def prepare(weight: Weight, bias: torch.Tensor | None) -> ProductState:
        assert isinstance(weight, QuantWeight)
        return _kept_state(weight, bias, weight.descriptor(compute_dtype))

    return Product(f"kept/{_DTYPE_NAMES[compute_dtype]}", _kept, prepare,
                   _kept_ladder(compute_dtype), _native_silu_mul, _kept_stack, torch.float32,
                   native=True)


# ---------------------------------------------------------------- repacked row
def _repacked(weight: Weight) -> bool:
    return isinstance(weight, QuantWeight) and repack.repackable(weight)


def _prepare_repacked(weight: Weight, bias: torch.Tensor | None) -> ProductState:
    assert isinstance(weight, QuantWeight)
    packed = repack.repack(weight)
    return ProductState(weight.in_features, weight.out_features, bias, packed=packed.data,
                        desc=packed.desc)


# Whether the products running now are of prompt rows (`prompt_rows`).
_PROMPT_ROWS = False


@contextlib.contextmanager
def prompt_rows(active: bool = True) -> Iterator[None]:
    """Within: the products computed are of prompt rows (a forward pass whose every row is
    a prompt token: the runner passes prompt rows and generated rows separately where
    `prompt_rows_differ()`). The repacked row computes them through
    `repack.product_bf16` where `repack.prompt_bf16()`; every other row, and every row
    outside, as without it."""
    global _PROMPT_ROWS
    before, _PROMPT_ROWS = _PROMPT_ROWS, active
    try:
        yield
    finally:
        _PROMPT_ROWS = before


def in_prompt_rows() -> bool:
    """Whether the forward pass running now is of prompt rows (within `prompt_rows(True)`):
    the attention then takes its prompt rows' kernel where it has one
    (`native.takes_prompt_rows`)."""
    return _PROMPT_ROWS


def prompt_rows_differ(chosen: dict[Product, list] | Iterator[Product]) -> bool:
    """Whether the rows `chosen` (select_products' answer) compute a prompt row otherwise
    than a generated one in this process: a repacked row where `repack.prompt_bf16()`."""
    return any(p.name.startswith("repacked/") for p in chosen) and repack.prompt_bf16()


def _bf16_prompt_rows() -> bool:
    """Whether the repacked row computes the rows running now through the AMX-BF16 tiles
    (prompt rows, in a process that has them)."""
    return _PROMPT_ROWS and repack.prompt_bf16()


def _repacked_gemm(state: ProductState, x: torch.Tensor) -> torch.Tensor:
    assert state.desc is not None
    if _bf16_prompt_rows():
        return repack.product_bf16(x.float(), state.desc, state.in_features,
                                   state.out_features, state.bias)
    return repack.product(x.float(), state.desc, state.in_features, state.out_features,
                          state.bias)


def _repacked_silu(state: ProductState, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass with the product where the weight allows
    (`repack.product_bf16_silu` for prompt rows on AMX-BF16, else `repack.product_silu`:
    the same bits as the two passes), else `native.silu_mul` on the product."""
    assert state.desc is not None
    if repack.silu_fusable(state.desc) and state.bias is None:
        if _bf16_prompt_rows():
            return repack.product_bf16_silu(x.float(), state.desc, state.in_features,
                                            state.out_features)
        return repack.product_silu(x.float(), state.desc, state.in_features,
                                   state.out_features)
    return native.silu_mul(_repacked_gemm(state, x))


def _repacked_stack(state: ProductState) -> StackWeight | None:
    assert state.desc is not None and state.packed is not None
    # the flag sends plait_qgemm there (repack.product's kernel, whatever the rows)
    return StackWeight(state.desc, (state.packed,), any_rows=True)


def _repacked_row() -> Product:
    """`repacked/<isa>`: the kept weight repacked once at its own bit width (repack.py:
    16 rows interleaved per block, 1.0-1.03x the blocks' bytes), every product through
    `repack.product` (x quantized to int8 per 32 weights, VNNI dot products), the native
    stack's included (the descriptor's PLAIT_QGEMM_REPACKED flag); prompt rows
    (`prompt_rows`) through `repack.product_bf16` where the process has AMX-BF16."""
    return Product(f"repacked/{repack.ISA_NAMES[repack.isa()]}", _repacked, _prepare_repacked,
                   (Rung(None, _repacked_gemm, silu=_repacked_silu, chunk_rows=_chunk_rows),),
                   _native_silu_mul, _repacked_stack, torch.float32, native=True)


# ---------------------------------------------------------------- the table
def table() -> dict[str, Product]:
    """Every row by name (the native rows only where the kernels are built; the repacked
    row only where its AVX512-VNNI kernel is: the plain C one is for tests)."""
    return _table(native.available())


@functools.cache
def _table(with_native: bool) -> dict[str, Product]:
    rows = [TORCH, MKL, ONEDNN]
    if with_native:
        rows += [_panels_row(blas) for blas in BLAS.values()]
        rows += [_kept_row(dtype) for dtype in _DTYPE_NAMES]
        if repack.isa() >= repack.ISA_VNNI512:
            rows.append(_repacked_row())
    return {r.name: r for r in rows}


def repacked_row() -> Product | None:
    """The table's repacked row, or None in a build without its VNNI kernel."""
    return next((r for r in table().values() if r.name.startswith("repacked/")), None)


def row(name: str) -> Product:
    """The row called `name`; KeyError naming the rows there are."""
    rows = table()
    if name not in rows:
        raise KeyError(f"no product row {name!r} (rows: {', '.join(rows)})")
    return rows[name]


@dataclass(frozen=True, slots=True)
class ProductSettings:
    """What chooses the rows: `blas` (a resolved `BLAS` name) for float32 CPU weights,
    under native panels with `panels`; the kept weights' `compute_dtype`, and `repacked`:
    the repacked row first where the build has it (the kept rows for the weights it does
    not take)."""

    blas: str = "none"
    panels: bool = False
    compute_dtype: torch.dtype = torch.float32
    repacked: bool = False

    def preference(self) -> tuple[Product, ...]:
        """The rows these settings choose from, in order: a weight takes the first whose
        `takes` accepts it (the "torch" row takes every dense weight)."""
        rows = table()
        dense: list[Product] = [BLAS[self.blas], TORCH]
        if self.panels and native.available():
            dense.insert(0, rows[f"panels/{BLAS[self.blas].name}"])
        if not native.available():
            return tuple(dense)
        kept = [rows[f"kept/{_DTYPE_NAMES[self.compute_dtype]}"]]
        repacked = repacked_row()
        if self.repacked and repacked is not None:
            kept.insert(0, repacked)
        return (*kept, *dense)

    def choose(self, weight: Weight) -> Product:
        """The row that computes `weight` under these settings."""
        for product in self.preference():
            if product.takes(weight):
                return product
        raise ValueError(f"no product row takes a weight of {_weight_text(weight)}")


def _weight_text(weight: Weight) -> str:
    if isinstance(weight, QuantWeight):
        return weight.describe()
    return f"{weight.dtype} on {weight.device}"


__all__ = ["BLAS", "MKL", "MKL_ROW_HINT", "MLP_CHUNK_BYTES", "MLP_CHUNK_MIN_ROWS",
           "NATIVE_MAX_ROWS", "ONEDNN", "QGEMM_MAX_ROWS", "SKINNY_ROWS", "TORCH", "Kernel",
           "Product", "ProductSettings", "ProductState", "Rung", "StackWeight", "Weight",
           "check_native", "in_prompt_rows", "prompt_rows", "prompt_rows_differ",
           "qgemm_max_rows", "repacked_row", "row", "table"]
