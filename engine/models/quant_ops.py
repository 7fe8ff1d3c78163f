"""The quantized kernels `QuantLinear` and `QuantEmbedding` call: the native C kernels
(`native.qgemm`, `native.dequantize`, `native.dequantize_bf16`, kernels/cpu/native.py) for
the GGML types they take, else gguf-py's reference dequantizer (`dequantize_reference`).

The reference path is slow, so a weight dequantized whole through it is cached in the
caller's `cache` dict (a float32 copy owned by the module: the memory the kept format saves
is then spent again, logged once per weight type); it exists so that every type loads and
runs while its native kernel is missing.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from plait.kernels.cpu import native
from plait.kernels.cpu.quant import KEPT_TYPES, QuantWeight, dequantize_reference

logger = logging.getLogger("plait.engine")

_WARNED: set[str] = set()


def native_types() -> frozenset[int]:
    """The GGML types the native quantized kernels take here (empty without them)."""
    if not hasattr(native, "qgemm") or not native.available():
        return frozenset()
    return frozenset(getattr(native, "QUANT_TYPES", KEPT_TYPES))


def runs_native(weight: QuantWeight) -> bool:
    """Whether the native kernels take every part of `weight`."""
    types = native_types()
    return all(p.ggml_type in types for p in weight.parts)


def _dense(weight: QuantWeight, cache: dict | None) -> torch.Tensor:  # [N, K] float32
    dense = None if cache is None else cache.get("dense")
    if dense is None:
        kind = weight.describe()
        if kind not in _WARNED:
            _WARNED.add(kind)
            logger.warning("no native kernel for %s weights: dequantized once by the "
                           "reference (a float32 copy)", kind)
        dense = dequantize_reference(weight)
        if cache is not None:
            cache["dense"] = dense
    return dense


def qgemm(x: torch.Tensor, weight: QuantWeight,  # x: [M, K] float32
          bias: torch.Tensor | None, cache: dict | None = None,
          ) -> torch.Tensor:  # [M, N] float32 dense
    """x @ W^T + bias."""
    if runs_native(weight):
        return native.qgemm(x, weight, bias)
    out = torch.mm(x, _dense(weight, cache).t())
    return out if bias is None else out.add_(bias)


def dequantize(weight: QuantWeight, rows: torch.Tensor | None = None,  # rows: [R] int64
               cache: dict | None = None) -> torch.Tensor:
    """W's rows `rows` (all rows when None) in float32: [R, K]."""
    if runs_native(weight):
        return native.dequantize(weight, rows)
    if rows is None:
        return _dense(weight, cache)
    if len(weight.parts) != 1:
        return _dense(weight, cache)[rows]
    part = weight.parts[0]
    raw = part.data[rows].numpy()  # rows are independent: dequantize just these
    values = gguf_dequantize(raw, GGMLQuantizationType(part.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)) \
        .reshape(rows.shape[0], weight.in_features)


def dequantize_bf16(weight: QuantWeight,
                    cache: dict | None = None) -> torch.Tensor:  # [N, K] bfloat16
    """W in bfloat16 (the native kernel's own when there is one)."""
    if runs_native(weight) and hasattr(native, "dequantize_bf16"):
        return native.dequantize_bf16(weight)
    return dequantize(weight, None, cache).to(torch.bfloat16)


__all__ = ["dequantize", "dequantize_bf16", "native_types", "qgemm", "runs_native"]
