"""The quantized kernels `QuantLinear` and `QuantEmbedding` call: the native C kernels
(`native.qgemm`, `native.dequantize`, `native.dequantize_bf16`, kernels/cpu/native.py) for
the GGML types they take, else gguf-py's reference dequantizer (`dequantize_reference`).

The reference path is slow, so a weight dequantized whole through it is cached in the
caller's `cache` dict (a float32 copy owned by the module: the memory the kept format saves
is then spent again, logged once per weight type); it exists so that every type loads and
runs while its native kernel is missing.

`matmul_dequantized` is a prefill's product (more rows than `qgemm` is fastest for): W is
dequantized into one process-wide scratch, reused by every weight, never a fresh tensor
(a fresh one above glibc's raised mmap threshold, engine/host_memory.py, page-faults a new
mapping on each call), and multiplied by oneDNN. A weight larger than the scratch's cap
(an LM head) goes in row chunks:

    W [N, K]:  rows [0, c) | [c, 2c) | ... | [.., N)     each dequantized into the scratch
    y [M, N]:  cols [0, c) | [c, 2c) | ... | [.., N)     = x @ chunk^T, written in place
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from plait.kernels.cpu import native
from plait.kernels.cpu.quant import KEPT_TYPES, QuantPart, QuantWeight, dequantize_reference

logger = logging.getLogger("plait.engine")

_WARNED: set[str] = set()

# The scratch's cap: Qwen2.5-0.5B's gate_up (9728 x 896 float32, 35 MB) fits whole; an LM
# head (vocab x hidden) goes in chunks of about this size.
SCRATCH_BYTES = 64 << 20
_MKLDNN = torch.backends.mkldnn.is_available()


class _Scratch:
    """One growing byte buffer (up to the largest chunk asked for) that `matmul_dequantized`
    dequantizes into; taken under a lock, a caller that finds it busy (another thread)
    gets a fresh tensor instead."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buf = torch.empty(0, dtype=torch.uint8)

    def view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:  # [rows, cols]
        nbytes = rows * cols * dtype.itemsize
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.buf[:nbytes].view(dtype).view(rows, cols)


_SCRATCH = _Scratch()


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


def row_chunks(weight: QuantWeight, chunk_rows: int,
               cache: dict | None = None) -> list[tuple[int, int, QuantWeight]]:
    """(start, end, W[start:end]) covering W's rows, each at most `chunk_rows` rows; a chunk
    views its parts' bytes (no copy) and may span parts. Kept in `cache` per chunk size."""
    key = ("chunks", chunk_rows)
    if cache is not None and key in cache:
        return cache[key]
    chunks = []
    for start in range(0, weight.out_features, chunk_rows):
        end, parts, at = min(start + chunk_rows, weight.out_features), [], 0
        for part in weight.parts:
            lo, hi = max(start, at), min(end, at + part.rows)
            if lo < hi:
                parts.append(QuantPart(part.data[lo - at:hi - at], part.ggml_type, hi - lo))
            at += part.rows
        chunks.append((start, end, QuantWeight.build(parts, weight.in_features)))
    if cache is not None:
        cache[key] = chunks
    return chunks


def _dense_product(x: torch.Tensor, w: torch.Tensor,  # x: [M, K], w: [c, K] same dtype
                   bias: torch.Tensor | None) -> torch.Tensor:  # [M, c] float32
    if _MKLDNN and w.dtype == torch.float32:
        # oneDNN on the plain weight: measured faster than torch.mm (BLAS) at prefill sizes
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    out = torch.mm(x, w.t()).float()
    return out if bias is None else out.add_(bias)


def matmul_dequantized(x: torch.Tensor, weight: QuantWeight,  # x: [M, K] float32
                       bias: torch.Tensor | None,  # [N] float32
                       compute_dtype: torch.dtype = torch.float32,  # or torch.bfloat16
                       cache: dict | None = None,
                       scratch_bytes: int = SCRATCH_BYTES,
                       ) -> torch.Tensor:  # [M, N] float32 dense
    """x @ W^T + bias with W dequantized to `compute_dtype` (bf16: x rounded to bf16, float32
    accumulation, the product rounded to bf16) into the shared scratch, in row chunks of at
    most `scratch_bytes` (see the module docstring). `cache`: the caller's, for the chunks'
    descriptors and the reference fallback."""
    if not runs_native(weight):
        w = dequantize(weight, None, cache).to(compute_dtype)
        return _dense_product(x.to(compute_dtype), w, bias).float()
    x = x.to(compute_dtype).contiguous()
    num_out, k = weight.out_features, weight.in_features
    chunk_rows = max(1, min(num_out, scratch_bytes // (k * compute_dtype.itemsize)))
    chunks = row_chunks(weight, chunk_rows, cache) if chunk_rows < num_out \
        else [(0, num_out, weight)]
    scratch = _SCRATCH if _SCRATCH.lock.acquire(blocking=False) else _Scratch()
    try:
        out = None if len(chunks) == 1 else x.new_empty(x.shape[0], num_out, dtype=torch.float32)
        for start, end, part in chunks:
            w = native.dequantize(part, None, compute_dtype,
                                  out=scratch.view(end - start, k, compute_dtype))
            y = _dense_product(x, w, None if bias is None else bias[start:end])
            if out is None:
                return y.float()
            out[:, start:end] = y
        return out
    finally:
        if scratch is _SCRATCH:
            scratch.lock.release()


__all__ = ["SCRATCH_BYTES", "dequantize", "dequantize_bf16", "matmul_dequantized",
           "native_types", "qgemm", "row_chunks", "runs_native"]
