"""A Q4_K encoder in numpy: float32 rows to GGML's block_q4_K bytes, which gguf-py's
`gguf.quants.dequantize(..., Q4_K)` and Plait's kernels (kernels/cpu/quant.py) read. gguf-py
only dequantizes Q4_K, and llama.cpp makes it with `llama-quantize` (a C++ build), so
helpers/gguf_convert.py requantizes its F32 GGUFs with this.

    quantize_q4_k(w)          w float32 [rows, K], K % 256 == 0 -> uint8 [rows, K / 256 * 144]
    dequantize_q4_k(blocks)   the inverse map, the same float32 bits as gguf-py's

One block holds 256 weights in 8 sub-blocks of 32 (144 bytes, little-endian):

    byte  0      2        4                 16                                  144
          | d f16 | dmin f16 | scales: 12 bytes | qs: 128 bytes of 4-bit codes    |

    weight l of sub-block j = (d * sc_j) * q - dmin * m_j      q in 0..15, sc_j, m_j in 0..63

    scales (sc_j, m_j 6 bits each; j < 4 whole in bytes 0..7, j >= 4 split):
        byte 0..3    sc_0..sc_3  | top 2 bits of sc_4..sc_7 in bits 6..7
        byte 4..7    m_0..m_3    | top 2 bits of m_4..m_7  in bits 6..7
        byte 8..11   low 4 bits of sc_4..sc_7 | low 4 bits of m_4..m_7 << 4
    qs: byte 32 * g + l = q(sub-block 2g, weight l) | q(sub-block 2g + 1, weight l) << 4

The fit, per sub-block (in the spirit of llama.cpp's make_qkx2_quants, written afresh): the
offset is -min(0, min x) (so m_j >= 0), the step (max x + offset) / 15; then 21 other
steps around it are tried, each with the codes it rounds to and a weighted least-squares
refit of step and offset over those codes (weights rms(x) + |x|: large weights count more),
and the fit of least weighted error is kept. A sub-block with no negative weight keeps
offset 0. Per block, d = max step / 63 and dmin = max offset / 63 in fp16, the 6-bit
sc_j / m_j rounded against those fp16 values, and every code rounded again against the step
and offset the file will actually hold.

Exact: an all-zero block is 144 zero bytes and an all-zero sub-block gives zeros
(sc_j = m_j = 0); a sub-block with no negative weight has m_j = 0, so its zeros stay zeros.
Otherwise the round trip is within the grid (tests/kernels/test_q4k_encoder.py states the
measured error: RMS 0.072 of RMS(w) on normal rows). fp16 d / dmin bound the range: blocks
of weights below ~1e-7 (d under fp16's smallest subnormal) come back 0, and a block needing
d or dmin past 65504 (|w| beyond ~4e6) is refused.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights per block
SUB = 32  # weights per sub-block
NUM_SUB = QK_K // SUB  # 8
BLOCK_BYTES = 2 + 2 + 12 + QK_K // 2  # 144
Q_MAX = 15  # 4-bit codes
SCALE_MAX = 63  # 6-bit sub-block scales and mins
# Bumped whenever the bytes for the same input change (the requantized GGUFs' cache key).
ENCODER_VERSION = 1
# The inverse steps tried per sub-block: (Q_MAX + _RMIN + _RDELTA * i) / span, i <= _NUM_STEPS.
_RMIN, _RDELTA, _NUM_STEPS = -1.0, 0.1, 20
_CHUNK = 4096  # sub-blocks fitted at once
_F16_MAX = float(np.finfo(np.float16).max)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Rows of float32 weights as Q4_K blocks.

    w: [rows, K] finite float32, K a multiple of 256. Returns uint8 [rows, K // 256 * 144],
    row r's blocks in order. Raises ValueError for another K, non-finite weights, or a block
    whose step or offset exceeds what fp16 d / dmin times 63 can hold (|w| beyond ~4e6)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"Q4_K rows hold multiples of {QK_K} weights, not shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("Q4_K cannot hold inf or nan")
    rows, k = w.shape
    x = w.reshape(-1, NUM_SUB, SUB)  # [B, 8, 32], B = rows * K / 256
    sub = x.reshape(-1, SUB)  # [B * 8, 32]
    # In chunks that stay in cache: ~2x faster than whole matrices.
    fits = [_fit_sub_blocks(sub[i:i + _CHUNK]) for i in range(0, len(sub), _CHUNK)]
    step = np.concatenate([f[0] for f in fits])  # [B * 8]
    offset = np.concatenate([f[1] for f in fits])  # [B * 8], >= 0
    d, sc = _six_bit(step.reshape(-1, NUM_SUB), "d")  # d f16 [B], sc uint8 [B, 8]
    dmin, m = _six_bit(offset.reshape(-1, NUM_SUB), "dmin")
    # The codes against what the file holds, computed as the dequantizer does.
    eff_step = (d.astype(np.float32)[:, None] * sc)[:, :, None]  # [B, 8, 1]
    eff_off = (dmin.astype(np.float32)[:, None] * m)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff_step > 0, np.rint((x + eff_off) / eff_step), 0)
    q = np.clip(q, 0, Q_MAX).astype(np.uint8)  # [B, 8, 32]
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8),
                             _pack_scales(sc, m), _pack_codes(q)], axis=1)  # [B, 144]
    return blocks.reshape(rows, k // QK_K * BLOCK_BYTES)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K rows back to float32: uint8 [rows, n * 144] -> float32 [rows, n * 256], each
    value (d * sc_j) * q - dmin * m_j in float32, in that order (gguf-py's bits)."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    rows = blocks.shape[0]
    b = blocks.reshape(-1, BLOCK_BYTES)  # [B, 144]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _unpack_scales(b[:, 4:16])  # [B, 8] each
    qs = b[:, 16:].reshape(-1, NUM_SUB // 2, 1, SUB)  # [B, 4, 1, 32]: sub-blocks 2g, 2g + 1
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, NUM_SUB, SUB)
    values = (d * sc.astype(np.float32))[:, :, None] * q.astype(np.float32) \
        - (dmin * m.astype(np.float32))[:, :, None]  # [B, 8, 32]
    return values.reshape(rows, -1)


def _fit_sub_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [S, 32]: (step, offset) with weight ~ step * q - offset, q in 0..15,
    step >= 0, offset >= 0, of least weighted squared error among the steps tried."""
    lo = np.minimum(x.min(axis=1), 0.0)  # [S]
    span = x.max(axis=1) - lo  # [S]
    weights = np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)  # [S, 32]
    flat = span == 0  # all zero, or all one negative value: offset alone
    anchored = lo == 0  # no negative weight: offset 0, so zeros stay exact
    safe_span = np.where(flat, 1.0, span)
    best_step = np.where(flat, 0.0, span / Q_MAX).astype(np.float32)
    best_off = (-lo).astype(np.float32)
    best_err = _weighted_error(x, weights, best_step, best_off)
    for i in range(_NUM_STEPS + 1):
        inv = (Q_MAX + _RMIN + _RDELTA * i) / safe_span  # [S]
        q = np.clip(np.rint(inv[:, None] * (x - lo[:, None])), 0, Q_MAX)  # [S, 32]
        step, off = _least_squares(x, weights, q, anchored)
        err = _weighted_error(x, weights, step, off, q)
        better = ~flat & np.isfinite(err) & (err < best_err)
        best_step = np.where(better, step, best_step)
        best_off = np.where(better, off, best_off)
        best_err = np.where(better, err, best_err)
    return best_step, best_off


def _least_squares(x: np.ndarray, weights: np.ndarray, q: np.ndarray, anchored: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The (step, offset >= 0) minimising sum weights * (step * q - offset - x)^2 for fixed
    codes q [S, 32], offset 0 where `anchored` [S]; where all codes are equal (no unique
    fit) the step is nan."""
    # Sums of 32 float32 terms, solved in float64 (det cancels when few codes differ).
    wq = weights * q  # [S, 32]
    sw = weights.sum(axis=1).astype(np.float64)
    sq = wq.sum(axis=1).astype(np.float64)
    sqq = (wq * q).sum(axis=1).astype(np.float64)
    sx = (weights * x).sum(axis=1).astype(np.float64)
    sqx = (wq * x).sum(axis=1).astype(np.float64)
    det = sw * sqq - sq * sq
    with np.errstate(divide="ignore", invalid="ignore"):
        step = (sw * sqx - sx * sq) / det
        off = -(sqq * sx - sq * sqx) / det  # the fit's intercept is -offset
        # An intercept above 0 is not storable (m_j >= 0): refit the step through the origin.
        through_zero = (off < 0) | anchored
        step = np.where(through_zero, sqx / sqq, step)
        off = np.where(through_zero, 0.0, off)
        step = np.where((det > 0) & (step >= 0), step, np.nan)
    return step.astype(np.float32), off.astype(np.float32)


def _weighted_error(x: np.ndarray, weights: np.ndarray, step: np.ndarray, off: np.ndarray,
                    q: np.ndarray | None = None) -> np.ndarray:
    """sum weights * (step * q - off - x)^2 per row; q: the nearest codes when None."""
    if q is None:
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(step[:, None] > 0, np.rint((x + off[:, None]) / step[:, None]), 0)
        q = np.clip(q, 0, Q_MAX)
    diff = step[:, None] * q - off[:, None] - x
    return (weights * diff * diff).sum(axis=1)


def _six_bit(values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """values float32 [B, 8] >= 0 -> (super-scale float16 [B], codes uint8 [B, 8]) with
    super * code ~ values: super = max / 63 in fp16, codes rounded against that fp16 value."""
    top = values.max(axis=1) / SCALE_MAX + np.float32(0.0)  # [B]; -0.0 + 0.0 is +0.0
    if (top > _F16_MAX).any():
        raise ValueError(f"a block's {name} would be {top.max():.4g}, past fp16's "
                         f"{_F16_MAX:g}: weights beyond Q4_K's range")
    super_ = top.astype(np.float16)
    s32 = super_.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s32 > 0, np.rint(values / s32), 0)
    return super_, np.clip(codes, 0, SCALE_MAX).astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m uint8 [B, 8] (6 bits) -> uint8 [B, 12] (layout in the module docstring)."""
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_m, hi_m = m[:, :4], m[:, 4:]
    return np.concatenate([lo_sc | (hi_sc >> 4) << 6, lo_m | (hi_m >> 4) << 6,
                           (hi_sc & 0x0F) | (hi_m & 0x0F) << 4], axis=1).astype(np.uint8)


def _unpack_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [B, 12] -> sc, m uint8 [B, 8]: the inverse of _pack_scales."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | (a >> 6) << 4], axis=1)
    m = np.concatenate([b & 0x3F, (c >> 4) | (b >> 6) << 4], axis=1)
    return sc, m


def _pack_codes(q: np.ndarray) -> np.ndarray:
    """q uint8 [B, 8, 32] in 0..15 -> uint8 [B, 128]: sub-block 2g in the low nibbles of
    bytes 32g..32g+31, sub-block 2g + 1 in their high nibbles."""
    pairs = q.reshape(-1, NUM_SUB // 2, 2, SUB)  # [B, 4, 2, 32]
    return (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(-1, QK_K // 2)
