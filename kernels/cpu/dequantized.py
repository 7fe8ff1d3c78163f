"""The large-row rung of the kept rows of the product table (kernels/cpu/products.py): a
weight kept in its file's GGML blocks (`quant.QuantWeight`) multiplied by BLAS.

`matmul_dequantized` is a prefill's product (more rows than `qgemm` is fastest for): W is
dequantized into one process-wide scratch, reused by every weight, never a fresh tensor
(a fresh one above glibc's raised mmap threshold, engine/host_memory.py, page-faults a new
mapping on each call), and multiplied by oneDNN. A weight larger than the scratch's cap
(an LM head) goes in row chunks:

    W [N, K]:  rows [0, c) | [c, 2c) | ... | [.., N)     each dequantized into the scratch
    y [M, N]:  cols [0, c) | [c, 2c) | ... | [.., N)     = x @ chunk^T, written in place
"""

from __future__ import annotations

import threading

import torch

from plait.kernels.cpu import native
from plait.kernels.cpu.quant import QuantPart, QuantWeight

# The scratch's cap: Qwen2.5-0.5B's gate_up (9728 x 896 float32, 35 MB) fits whole; an LM
# head (vocab x hidden) goes in chunks of about this size.
SCRATCH_BYTES = 64 << 20
_MKLDNN = torch.backends.mkldnn.is_available()
# oneDNN's bf16 GEMM keeps its rate (about 390-415 GFLOP/s on the 2-core AVX512-BF16 host)
# when x's rows are a multiple of 16, and loses up to a quarter of it at many other counts
# above a few hundred (Qwen2.5-0.5B's layer shapes: 284 GFLOP/s at 533 rows, 364-380 at 532,
# 534 and 544; docs/bench/history.md, "Rows padded to 16"). A bf16 product of at least
# PAD_FROM_ROWS rows runs on x padded with zero rows to the next multiple of PAD_ROWS (under
# 6% more rows); the padding's output rows are dropped.
PAD_ROWS = 16
PAD_FROM_ROWS = 256

RowChunks = list[tuple[int, int, QuantWeight]]  # (start, end, W[start:end]) per chunk
ChunkCache = dict[tuple[str, int], RowChunks]  # a weight's row chunks, per chunk size


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


def row_chunks(weight: QuantWeight, chunk_rows: int,
               cache: ChunkCache | None = None) -> RowChunks:
    """(start, end, W[start:end]) covering W's rows, each at most `chunk_rows` rows; a chunk
    views its parts' bytes (no copy) and may span parts. Kept in `cache` per chunk size."""
    key = ("chunks", chunk_rows)
    if cache is not None and key in cache:
        return cache[key]
    chunks: RowChunks = []
    for start in range(0, weight.out_features, chunk_rows):
        end, at = min(start + chunk_rows, weight.out_features), 0
        parts: list[QuantPart] = []
        for part in weight.parts:
            lo, hi = max(start, at), min(end, at + part.rows)
            if lo < hi:
                parts.append(QuantPart(part.data[lo - at:hi - at], part.ggml_type, hi - lo))
            at += part.rows
        chunks.append((start, end, QuantWeight.build(parts, weight.in_features)))
    if cache is not None:
        cache[key] = chunks
    return chunks


def padded_rows(x: torch.Tensor,  # [M, K]
                compute_dtype: torch.dtype) -> torch.Tensor:  # [M', K] compute_dtype dense
    """x in `compute_dtype`, contiguous; in bfloat16 with at least PAD_FROM_ROWS rows, followed
    by zero rows up to the next multiple of PAD_ROWS (M' >= M; rows [0, M) are x's)."""
    rows = x.shape[0]
    if compute_dtype != torch.bfloat16 or rows < PAD_FROM_ROWS or rows % PAD_ROWS == 0:
        return x.to(compute_dtype).contiguous()
    out = x.new_empty(-(-rows // PAD_ROWS) * PAD_ROWS, x.shape[1], dtype=compute_dtype)
    out[:rows].copy_(x)
    out[rows:].zero_()
    return out


def _dense_product(x: torch.Tensor, w: torch.Tensor,  # x: [M, K], w: [c, K] same dtype
                   bias: torch.Tensor | None,  # [c] float32
                   widen: bool) -> torch.Tensor:  # [M, c] float32, or w's dtype (not widen)
    if _MKLDNN and w.dtype == torch.float32:
        # oneDNN on the plain weight: measured faster than torch.mm (BLAS) at prefill sizes
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    out = torch.mm(x, w.t())  # rounded to w's dtype
    if bias is None:
        return out.float() if widen else out
    out = out.float().add_(bias)  # the bias added in float32
    return out if widen else out.to(w.dtype)


def matmul_dequantized(x: torch.Tensor, weight: QuantWeight,  # x: [M, K] float32
                       bias: torch.Tensor | None,  # [N] float32
                       compute_dtype: torch.dtype = torch.float32,  # or torch.bfloat16
                       cache: ChunkCache | None = None,
                       scratch_bytes: int = SCRATCH_BYTES,
                       widen: bool = True,
                       ) -> torch.Tensor:  # [M, N] float32 dense (or compute_dtype)
    """x @ W^T + bias with W dequantized to `compute_dtype` (bf16: x rounded to bf16, float32
    accumulation, the product rounded to bf16) into the shared scratch, in row chunks of at
    most `scratch_bytes` (see the module docstring). `cache`: the caller's, for the chunks'
    descriptors. `widen=False` returns the product in `compute_dtype` as BLAS rounded it
    (bf16: what a following bf16 product would take, with no float32 copy between; a bias
    is added in float32 and the sum rounded)."""
    rows = x.shape[0]
    x = padded_rows(x, compute_dtype)
    num_out, k = weight.out_features, weight.in_features
    chunk_rows = max(1, min(num_out, scratch_bytes // (k * compute_dtype.itemsize)))
    chunks = row_chunks(weight, chunk_rows, cache) if chunk_rows < num_out \
        else [(0, num_out, weight)]
    scratch = _SCRATCH if _SCRATCH.lock.acquire(blocking=False) else _Scratch()

    def product(start: int, end: int, part: QuantWeight) -> torch.Tensor:  # [M, end - start]
        w = native.dequantize(part, None, compute_dtype,
                              out=scratch.view(end - start, k, compute_dtype))
        return _dense_product(x, w, None if bias is None else bias[start:end], widen)[:rows]

    try:
        if len(chunks) == 1:
            return product(*chunks[0])
        out = x.new_empty(rows, num_out, dtype=torch.float32 if widen else compute_dtype)
        for start, end, part in chunks:
            out[:, start:end] = product(start, end, part)
        return out
    finally:
        if scratch is _SCRATCH:
            scratch.lock.release()


__all__ = ["PAD_FROM_ROWS", "PAD_ROWS", "SCRATCH_BYTES", "ChunkCache", "RowChunks",
           "matmul_dequantized", "padded_rows", "row_chunks"]
