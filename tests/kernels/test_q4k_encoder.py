"""helpers/q4k.py, the numpy Q4_K encoder behind the Q4_K family GGUFs: its bytes are GGML's
block_q4_K (gguf-py's dequantizer and Plait's native one read them as the encoder's own
dequantization does, bit for bit), its round trip is close on normal data, and edge blocks
stay finite (exact where the format allows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers.q4k import BLOCK_BYTES, dequantize_q4_k, quantize_q4_k

from plait.kernels.cpu import native, quant
from plait.kernels.cpu.quant import QuantPart, QuantWeight

Q4_K = GGMLQuantizationType.Q4_K
# Measured on standard-normal rows (seeds 0..4, 256 x 1024): RMS(error) / RMS(w) from
# 0.0717 to 0.0719 (gguf-py's Q4_1 on the same rows: 0.078), and per sub-block of 32 the
# largest |error| at most 0.065 of the sub-block's span (max - min(min, 0)).
REL_RMS_BOUND = 0.075
SPAN_FRACTION_BOUND = 0.08


def _rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))


def _normal(rows: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, k)) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (3, 1280)])
def test_blocks_have_the_q4_k_shape(shape: tuple[int, int]) -> None:
    blocks = quantize_q4_k(_normal(*shape))
    assert blocks.dtype == np.uint8
    assert blocks.shape == (shape[0], shape[1] // 256 * BLOCK_BYTES)
    assert quant.row_bytes(quant.Q4_K, shape[1]) == blocks.shape[1]


@pytest.mark.parametrize("seed", range(3))
def test_gguf_py_reads_the_encoders_values_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # normal, heavy-tailed, and shifted rows (sub-blocks with and without negative weights)
    w = np.concatenate([rng.standard_normal((8, 768)), rng.laplace(size=(8, 768)),
                        rng.standard_normal((8, 768)) + 2.5]).astype(np.float32)
    blocks = quantize_q4_k(w)
    mine = dequantize_q4_k(blocks)
    ref = dequantize(blocks, Q4_K)
    assert ref.dtype == np.float32 and ref.shape == w.shape
    np.testing.assert_array_equal(mine.view(np.uint32), ref.view(np.uint32))


def test_plaits_kernels_read_the_encoders_values_bit_for_bit() -> None:
    w = _normal(37, 512, seed=3)
    blocks = quantize_q4_k(w)
    weight = QuantWeight.build([QuantPart(torch.from_numpy(blocks), quant.Q4_K, 37)], 512)
    assert torch.equal(native.dequantize(weight), torch.from_numpy(dequantize_q4_k(blocks)))


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_error_on_normal_rows(seed: int) -> None:
    w = _normal(256, 1024, seed)
    got = dequantize_q4_k(quantize_q4_k(w))
    assert _rel_rms(got, w) < REL_RMS_BOUND
    # More accurate than gguf-py's Q4_1 (fp16 scale and min per 32 weights, 5 bits/weight).
    q4_1 = dequantize(quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    assert _rel_rms(got, w) < _rel_rms(q4_1, w)
    sub, err = w.reshape(-1, 32), (got - w).reshape(-1, 32)
    span = sub.max(axis=1) - np.minimum(sub.min(axis=1), 0)
    assert (np.abs(err).max(axis=1) <= SPAN_FRACTION_BOUND * span).all()


@pytest.mark.parametrize("scale", [1e-5, 1e-3, 1e3, 1e5])
def test_round_trip_is_scale_free_within_fp16s_range(scale: float) -> None:
    """d and dmin are fp16: from 1e-5 (subnormal d) to 1e5 (past fp16's 65504 for the weights
    themselves) the relative error stays that of unit weights."""
    w = _normal(16, 512, seed=7, scale=scale)
    got = dequantize_q4_k(quantize_q4_k(w))
    assert np.isfinite(got).all()
    assert _rel_rms(got, w) < REL_RMS_BOUND


def test_zero_blocks_and_sub_blocks_are_exact() -> None:
    w = np.zeros((2, 512), np.float32)
    w[1, 256:] = _normal(1, 256, seed=1)
    w[1, 256 + 64:256 + 96] = 0.0  # one zero sub-block inside a nonzero block
    blocks = quantize_q4_k(w)
    assert not blocks[0].any() and not blocks[1, :BLOCK_BYTES].any()  # every byte 0
    got = dequantize_q4_k(blocks)
    assert (got[0] == 0).all() and (got[1, :256] == 0).all()
    assert (got[1, 256 + 64:256 + 96] == 0).all()


def test_zeros_of_a_non_negative_sub_block_stay_zero() -> None:
    w = np.abs(_normal(4, 256, seed=2))
    w[:, ::3] = 0.0
    got = dequantize_q4_k(quantize_q4_k(w))
    assert (got[:, ::3] == 0).all()
    assert _rel_rms(got, w) < REL_RMS_BOUND


@pytest.mark.parametrize("value", [0.37, -0.37, 1.0, -1.0, 3e4, -2e5, 0.1, -1e-2])
def test_constant_blocks(value: float) -> None:
    """A constant block comes back as one value, within 1e-3 of it (measured: 3.6e-4 at
    most) while d (value / 945) or dmin (-value / 63) is a normal fp16; smaller positive
    constants get a subnormal d (0.01: 2.6e-3)."""
    w = np.full((1, 256), value, np.float32)
    got = dequantize_q4_k(quantize_q4_k(w))
    assert len(np.unique(got)) == 1
    assert abs(got[0, 0] - value) <= 1e-3 * abs(value)


def test_all_negative_rows() -> None:
    w = -np.abs(_normal(8, 512, seed=4)) - 1.0
    got = dequantize_q4_k(quantize_q4_k(w))
    assert (got < 0).all()
    assert _rel_rms(got - w.mean(), w - w.mean()) < REL_RMS_BOUND * 2


def test_tiny_magnitudes_flush_to_zero_not_to_nan() -> None:
    """Weights around 1e-9 need d below fp16's smallest subnormal: they come back 0."""
    w = _normal(2, 256, seed=5, scale=1e-9)
    got = dequantize_q4_k(quantize_q4_k(w))
    assert np.isfinite(got).all()
    assert (np.abs(got - w) <= np.abs(w).max()).all()


def test_a_row_of_huge_values_among_small_ones() -> None:
    w = _normal(3, 512, seed=6)
    w[1] *= 1e5
    got = dequantize_q4_k(quantize_q4_k(w))
    assert np.isfinite(got).all()
    for row in range(3):  # rows are independent: the small ones keep their precision
        assert _rel_rms(got[row], w[row]) < REL_RMS_BOUND * 1.2


def test_what_q4_k_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 256"):
        quantize_q4_k(np.zeros((2, 320), np.float32))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_q4_k(np.full((1, 256), np.nan, np.float32))
    with pytest.raises(ValueError, match="beyond Q4_K's range"):
        quantize_q4_k(_normal(1, 256, scale=1e7))
