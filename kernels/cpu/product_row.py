"""The type of a row of the product table (kernels/cpu/products.py, whose docstring says
what a row holds and how to add one): `Product`, its ladder's `Rung`s, the `ProductState`
its `prepare` writes for one weight, and the `StackWeight` the native stack reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from plait.kernels.cpu.dequantized import ChunkCache
from plait.kernels.cpu.quant import QuantWeight

Kernel = Callable[["ProductState", torch.Tensor], torch.Tensor]  # (state, x [M, K]) -> y
Weight = torch.Tensor | QuantWeight  # [N, K] dense (a Parameter), or kept GGML blocks


@dataclass(frozen=True, slots=True)
class ProductState:
    """What a row's kernels read for one weight, written once by the row's `prepare`.
    `weight` / `qweight`: the weight as loaded (the module's Parameter, shared by ties; or
    the kept blocks); `packed`: the row's own copy (MKL pack, oneDNN layout, float32
    panels, the repacked weight); `large`: the BLAS row's state under native panels;
    `desc`: the int64 descriptor qgemm and the native stack read; `scratch`: the
    dequantized product's row chunks."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None  # [N] (kept rows: float32 contiguous)
    weight: torch.Tensor | None = None  # [N, K]
    qweight: QuantWeight | None = None
    packed: torch.Tensor | None = None
    large: ProductState | None = None
    desc: torch.Tensor | None = None  # int64
    scratch: ChunkCache = field(default_factory=dict)

    def copies(self) -> tuple[torch.Tensor, ...]:
        """The tensors this state holds beside the loaded weight (their bytes are resident
        on top of it)."""
        own = () if self.packed is None else (self.packed,)
        return own if self.large is None else (*own, *self.large.copies())


@dataclass(frozen=True, slots=True)
class Rung:
    """Products of at most `max_rows` rows (None: any) run `kernel`. `silu`: the fused form
    of silu_mul(kernel(x)) for a gate | up weight (None: not fused); `chunk_rows(state, M)`:
    the rows per chunk an MLP of two products of this row should run in (None: one pass)."""

    max_rows: int | None
    kernel: Kernel
    silu: Kernel | None = None
    chunk_rows: Callable[[ProductState, int], int | None] | None = None


@dataclass(frozen=True, slots=True)
class StackWeight:
    """A weight as `plait_decoder_stack` reads it: its descriptor and the tensors the
    descriptor points into (kept alive by the stack); `any_rows`: the stack's C product
    (plait_qgemm on `desc`) is the row's kernel for any number of rows, so a step of more
    than NATIVE_MAX_ROWS rows may run in the stack with the layer loop's bits (else only
    the few rows a decode step has, where the row's ladder starts with that kernel)."""

    desc: torch.Tensor  # int64
    tensors: tuple[torch.Tensor, ...]
    any_rows: bool = False


@dataclass(frozen=True, slots=True)
class Product:
    """One row of the table (the module docstring). `out_dtype`: the dtype of a product of
    zero rows (None: x's)."""

    name: str
    takes: Callable[[Weight], bool]
    prepare: Callable[[Weight, torch.Tensor | None], ProductState]
    ladder: tuple[Rung, ...]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]  # [T, 2 I] -> [T, I]
    stack: Callable[[ProductState], StackWeight | None]
    out_dtype: torch.dtype | None = None
    native: bool = False  # whether the row needs the native kernels

    def rung(self, rows: int) -> Rung:
        """The rung a product of `rows` rows runs."""
        for rung in self.ladder:
            if rung.max_rows is None or rows <= rung.max_rows:
                return rung
        raise ValueError(f"product {self.name}: no rung for {rows} rows")

    def __call__(self, state: ProductState, x: torch.Tensor,  # [M, K] -> [M, N]
                 rows: int | None = None) -> torch.Tensor:
        """x @ W^T + bias through the rung of `rows` rows (default: x's; a chunk of a
        larger product passes the whole's, so that its rows compute as the whole's)."""
        if x.shape[0] == 0:
            return x.new_empty(0, state.out_features, dtype=self.out_dtype or x.dtype)
        return self.rung(x.shape[0] if rows is None else rows).kernel(state, x)

    def silu(self, state: ProductState, x: torch.Tensor,  # [M, K] -> [M, N / 2]
             fused: bool = True, rows: int | None = None) -> torch.Tensor:
        """silu(gate) * up of this gate | up weight's product (the rung of `rows` rows, as
        `__call__`): the rung's fused kernel where it has one and `fused`, else the row's
        `silu_mul` on the product."""
        if x.shape[0] == 0:
            return self.silu_mul(self(state, x))
        rung = self.rung(x.shape[0] if rows is None else rows)
        if fused and rung.silu is not None:
            return rung.silu(state, x)
        return self.silu_mul(rung.kernel(state, x))

    def describe(self) -> str:
        """The ladder in words: "<= 24: gemm | any: onednn"."""
        return " | ".join(f"{'any' if r.max_rows is None else f'<= {r.max_rows}'}: "
                          f"{getattr(r.kernel, '__name__', 'kernel').strip('_')}"
                          for r in self.ladder)


__all__ = ["Kernel", "Product", "ProductState", "Rung", "StackWeight", "Weight"]
