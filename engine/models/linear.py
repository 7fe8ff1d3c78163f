"""The model's linear layers: one `Linear` class whose products run a row of the product
table (kernels/cpu/products.py), chosen once at load by `select_products`.

A `Linear` holds its weight as loaded (a dense [out, in] Parameter, shared by ties such as
the LM head's, or a `QuantWeight` kept in its file's blocks: `Linear.kept`), its bias,
`.product` (the row) and `.state` (what the row's `prepare` packed and described). The
model never looks at either: it calls the layer, `silu_mul` for a gate | up projection,
and `stack_weight` when it gathers the native stack.

A dense layer that no one selected computes through the "torch" row over its current
weight; a kept layer starts on "kept/f32" (exact float32 products). The runner calls
`select_products` once, after loading and before binding the KV caches; it logs one line
per row it chose.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import cast

import torch
from torch import nn

from plait.engine.config import CPU_GEMMS
from plait.engine.numerics import Numerics
from plait.kernels import TorchOps
from plait.kernels.cpu import native, repack
from plait.kernels.cpu.products import (
    TORCH,
    Product,
    ProductSettings,
    ProductState,
    StackWeight,
    check_native,
    prompt_rows_differ,
    row,
)
from plait.kernels.cpu.quant import QuantWeight

logger = logging.getLogger("plait.engine")


class Linear(nn.Module):
    """y = x @ W^T + bias through `self.product` (a product-table row) over `self.state`.
    `weight` [out, in] is a Parameter for a dense layer and None for a kept one (then
    `qweight` holds the blocks)."""

    weight: torch.Tensor | None  # [out, in], an nn.Parameter (a tied head shares it)
    bias: torch.Tensor | None  # [out]
    qweight: QuantWeight | None
    product: Product
    state: ProductState | None  # None: unselected dense (the torch row, prepared per call)

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.qweight, self.product, self.state = None, TORCH, None
        self.dropped: str | None = None  # the types of blocks released by drop_blocks

    @classmethod
    def kept(cls, qweight: QuantWeight, bias: torch.Tensor | None = None) -> Linear:
        """A layer over weights kept in their file's format (the native kernels must take
        every part: `check_native`), on the exact "kept/f32" row until selected."""
        check_native(qweight)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = qweight.in_features, qweight.out_features
        new.register_parameter("weight", None)  # no float copy: `qweight` is the weight
        new.bias = None if bias is None else nn.Parameter(bias.float().contiguous(),
                                                          requires_grad=False)
        new.qweight, new.dropped = qweight, None
        new.select(row("kept/f32"))
        return new

    def source(self) -> torch.Tensor | QuantWeight:
        """The weight as loaded: the kept blocks, or the dense Parameter. RuntimeError once
        `drop_blocks` released the blocks."""
        if self.qweight is not None:
            return self.qweight
        if self.weight is None:
            raise RuntimeError(f"this layer's kept blocks ({self.dropped}) were released "
                               f"once repacked: it computes only through {self.product.name}")
        return self.weight

    def drop_blocks(self) -> bool:
        """Release the kept blocks where the row's state does not read them (the repacked
        row's: its own layout replaces them), so that they are freed once nothing else
        holds them; the layer then computes only through that row (`select` raises).
        Returns whether it released them."""
        if self.qweight is None or self.state is None or self.state.qweight is not None:
            return False
        self.dropped, self.qweight = self.qweight.describe(), None
        return True

    def select(self, product: Product) -> None:
        """Compute through `product` from now on: its `prepare` packs the weight once (call
        again after the weight changes). ValueError when the row does not take it."""
        if not product.takes(self.source()):
            raise ValueError(f"product {product.name} does not take {self!r}")
        self.product, self.state = product, product.prepare(self.source(), self.bias)

    def _state(self) -> ProductState:
        if self.state is not None:
            return self.state
        return TORCH.prepare(self.source(), self.bias)  # unselected: the current weight

    def forward(self, x: torch.Tensor,  # [T, in] -> [T, out]
                rows: int | None = None) -> torch.Tensor:
        """The product through the row's rung for `rows` rows (default: T; a chunk of a
        larger product passes the whole's row count)."""
        return self.product(self._state(), x, rows)

    def silu_mul(self, x: torch.Tensor,  # [T, in] -> [T, out / 2]
                 fused: bool = True, rows: int | None = None) -> torch.Tensor:
        """silu(gate) * up of this gate | up projection, fused where the row's rung has a
        fused kernel and `fused` (the caller's next product is of the same row, which
        takes the fused kernel's output as it is); `rows` as `forward`'s."""
        return self.product.silu(self._state(), x, fused, rows)

    def chunk_rows(self, rows: int) -> int | None:
        """The rows per chunk an MLP over this gate | up projection and a down projection
        of the same row runs in (None: one pass)."""
        if rows == 0:
            return None
        rung = self.product.rung(rows)
        return None if rung.chunk_rows is None else rung.chunk_rows(self._state(), rows)

    def stack_weight(self) -> StackWeight | None:
        """What the native stack reads for this layer, or None where the row has none."""
        return None if self.state is None else self.product.stack(self.state)

    def extra_repr(self) -> str:
        types = "" if self.qweight is None else f", types={self.qweight.describe()}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, product={self.product.name}{types}")


class QuantEmbedding(nn.Module):
    """Token embeddings kept as a one-part `QuantWeight` [vocab, hidden]: a lookup
    dequantizes just the requested rows."""

    def __init__(self, qweight: QuantWeight) -> None:
        super().__init__()
        check_native(qweight)
        self.qweight: QuantWeight | None = qweight  # None once use_repacked
        self.num_embeddings, self.embedding_dim = qweight.out_features, qweight.in_features

        self.repacked: ProductState | None = None  # use_repacked's

    @property
    def blocks(self) -> QuantWeight:
        """The kept blocks (what a tied LM head is built over at load); RuntimeError once
        `use_repacked` released them."""
        if self.qweight is None:
            raise RuntimeError("the embedding's blocks were released once repacked")
        return self.qweight

    def use_repacked(self, state: ProductState) -> None:
        """Read the rows from a repacked row's state over the same weight (a tied LM head's:
        `repack.dequantize_rows`, gguf-py's bits, as before) and release the blocks."""
        if state.desc is None or state.packed is None or \
                (state.out_features, state.in_features) != (self.num_embeddings,
                                                             self.embedding_dim):
            raise ValueError("use_repacked: not a repacked state of this embedding's shape")
        self.repacked, self.qweight = state, None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] f32
        ids = token_ids.to(torch.int64).contiguous()
        if self.repacked is not None:
            assert self.repacked.desc is not None
            return repack.dequantize_rows(self.repacked.desc, self.embedding_dim,
                                          self.num_embeddings, ids)
        assert self.qweight is not None
        return native.dequantize(self.qweight, ids)

    def extra_repr(self) -> str:
        held = "repacked" if self.qweight is None else f"types={self.qweight.describe()}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {held}"


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(kept, dense): the bytes of `model`'s weights kept in their file's format (each
    `QuantWeight` once), and of the rest: float parameters plus each row's own packed
    copies (panels, MKL/oneDNN packs, repacked weights). Buffers (RoPE tables) are not
    weights."""
    kept: dict[int, int] = {}
    dense: dict[int, int] = {}
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if isinstance(qweight, QuantWeight):
            kept[id(qweight)] = qweight.nbytes
        if isinstance(module, Linear) and module.state is not None:
            for copy in module.state.copies():
                dense[id(copy)] = copy.numel() * copy.element_size()
    for param in model.parameters():
        dense[id(param)] = param.numel() * param.element_size()
    return sum(kept.values()), sum(dense.values())


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
    """The BLAS row for `requested` (one of `CPU_GEMMS`): itself, or for "auto" mkl on
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


def product_settings(numerics: Numerics, ops: TorchOps) -> ProductSettings:
    """The table's settings for an engine of `numerics` over the ops table `ops`: its BLAS
    (`cpu_gemm`, resolved), native panels where it runs the native kernels, and its
    `compute_dtype` (the engine's one copy, the numerics', held by `ops`: the attention's
    and the kept products'); the repacked row where the numerics repack."""
    return ProductSettings(ops.cpu_gemm, ops.native, ops.compute_dtype, numerics.repacked)


def apply_products(model: nn.Module, settings: ProductSettings) -> dict[Product, list[Linear]]:
    """Every `Linear` of `model` on the row `settings` choose for its weight, prepared
    once; the linears by row."""
    chosen: dict[Product, list[Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            product = settings.choose(module.source())
            module.select(product)
            chosen.setdefault(product, []).append(module)
    drop_replaced_blocks(model)
    return chosen


def drop_replaced_blocks(model: nn.Module) -> None:
    """Every kept linear whose row no longer reads its blocks (the repacked row) releases
    them (`Linear.drop_blocks`); an embedding over the same blocks (a tied LM head's) then
    reads its rows from that linear's repacked layout (`QuantEmbedding.use_repacked`), so
    the blocks are freed. An embedding of its own keeps its blocks."""
    dropped: dict[int, tuple[QuantWeight, Linear]] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.qweight is not None:
            qweight = module.qweight
            if module.drop_blocks():
                dropped[id(qweight)] = (qweight, module)
    for module in model.modules():
        if isinstance(module, QuantEmbedding) and module.qweight is not None \
                and id(module.qweight) in dropped:
            state = dropped[id(module.qweight)][1].state
            assert state is not None
            module.use_repacked(state)


def select_products(model: nn.Module, numerics: Numerics) -> dict[Product, list[Linear]]:
    """The runner's one call, once the weights are loaded (on their device) and before the
    KV caches are bound: `apply_products` with `product_settings(numerics, model.ops)`,
    logged one line per distinct row (its linears, their weight types, its ladder)."""
    settings = product_settings(numerics, cast(TorchOps, model.ops))
    chosen = apply_products(model, settings)
    for product, linears in chosen.items():
        types = Counter(m.qweight.describe() if m.qweight is not None else m.dropped or
                        str(m.weight.dtype if m.weight is not None else None).removeprefix(
                            "torch.") for m in linears)
        logger.info("products: %s for %d linears (%s): %s", product.name, len(linears),
                    ", ".join(f"{n} {t}" for t, n in sorted(types.items())), product.describe())
    if any(product.name.startswith("repacked/") for product in chosen):
        unused = repack.amx_unused()
        if unused is not None:
            logger.info("products: the AMX-INT8 prefill rung is %s", unused)
    if prompt_rows_differ(chosen):
        logger.info("products: prompt rows through AMX-BF16 tiles (x and the repacked "
                    "weights' values rounded to bfloat16, float32 sums; their attention "
                    "too where the layer allows it: %s), generated rows through the int8 "
                    "kernels", "yes" if native.prompt_attention_amx() else "no")
    return chosen


__all__ = ["CPU_GEMMS", "Linear", "QuantEmbedding", "apply_products", "cpu_vendor",
           "drop_replaced_blocks",
           "product_settings", "resolve_cpu_gemm", "select_products", "weight_bytes"]
