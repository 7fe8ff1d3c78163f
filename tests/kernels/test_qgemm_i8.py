"""`native.qgemm_i8` (kernels/cpu/qgemm_i8.h): x quantized to int8 per group of 32 weights
(16 where a part is Q6_K), VNNI dot products against the blocks' integer codes, float32
scales and sums. Checked against a float64 product of the same quantized x (quantized here
by the rule the kernel states) with the dequantized weights, for every block type, row
counts around the 4-row tiles, column counts around the 32-row panel pairs, mixed parts,
bias and strides; the tolerance is tight enough that the unquantized x, or x quantized in
groups of another size, fails it. The fused silu is `native.silu_mul`'s bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.native_builds import library_without_avx512vnni
from helpers.quant_cases import MIXED_PARTS, random_part, random_weight

from plait.kernels.cpu import build, native, quant
from plait.kernels.cpu.quant import QuantWeight

pytestmark = pytest.mark.skipif(not build.available() or not native.has_qgemm_i8(),
                                reason="no qgemm_i8 in this build (needs AVX512-VNNI)")

SHAPES = build.ABI.constants["PLAIT_ERR_SHAPES"]
I8_TYPES = sorted(native.I8_TYPES)
# |y - x_q @ W^T - bias| per element relative to sum |x_q| |w| (+ |bias|): float32 sums of
# exact int32 dot products stay near 1e-7 (measured); one x element rounded the other way
# is off by ~1e-5, x unquantized by ~1e-3.
TOLERANCE = 1e-6


def _group(weight: QuantWeight) -> int:
    return 16 if any(p.ggml_type == quant.Q6_K for p in weight.parts) else 32


def _quantized(x: torch.Tensor, group: int) -> torch.Tensor:  # [M, K] float64
    """x as the kernel quantizes it: per group, amax = max |x|, q = round-half-even(x *
    (127 / amax)) in float32 (0 where amax is 0), x_q = q * (amax / 127)."""
    rows, k = x.shape
    xg = x.view(rows, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    # a true division (torch's `127.0 / t` multiplies by t's reciprocal: other bits)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv)
    assert q.abs().max() <= 127
    return (q.double() * (amax / 127.0).double()).view(rows, k)


def _error(y: torch.Tensor, xd: torch.Tensor, weight: QuantWeight,
           bias: torch.Tensor | None = None) -> float:
    w = native.dequantize(weight).double()
    want, scale = xd @ w.T, xd.abs() @ w.abs().T
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    return ((y.double() - want).abs() / (scale + 1e-30)).max().item()


@pytest.mark.parametrize(("ggml_type", "k"), [(t, k) for t in I8_TYPES for k in (512, 1536)],
                         ids=str)
def test_every_type_and_row_count(ggml_type: int, k: int) -> None:
    """1 .. 9 rows (tiles of 4 and their tails) and 67, 37 weight rows (a panel pair and a
    tail of 5); the result is the quantized x's, not x's, nor x's in other groups."""
    weight = random_weight((ggml_type,), (37,), k, seed=ggml_type)
    group = _group(weight)
    gen = torch.Generator().manual_seed(k)
    for rows in (*range(1, 10), 67):
        x = torch.randn(rows, k, generator=gen)
        assert _error(native.qgemm_i8(x, weight), _quantized(x, group), weight) <= TOLERANCE
    y = native.qgemm_i8(x, weight)
    assert _error(y, x.double(), weight) > 10 * TOLERANCE
    assert _error(y, _quantized(x, 48 - group), weight) > 10 * TOLERANCE


@pytest.mark.parametrize(("types", "k"), MIXED_PARTS[1:], ids=str)
@pytest.mark.parametrize("rows", [1, 6, 33])
def test_parts_bias_and_strides(types: tuple[int, ...], k: int, rows: int) -> None:
    """Parts of four types meeting inside a panel, 44 weight rows (a pair and a tail of 12),
    a bias, x and y rows inside wider buffers: the rest of y untouched."""
    weight = random_weight(types, (5, 16, 3, 20), k, seed=rows)
    n = weight.out_features
    gen = torch.Generator().manual_seed(rows)
    wide_x, bias = torch.randn(rows, k + 24, generator=gen), torch.randn(n, generator=gen)
    x = wide_x[:, 8:8 + k]
    y_wide = torch.full((rows, n + 13), 7.0)
    rc = build.loaded().plait_qgemm_i8(x.data_ptr(), rows, wide_x.stride(0),
                                       weight.desc.data_ptr(), k, bias.data_ptr(), 0,
                                       y_wide[:, 4:].data_ptr(), y_wide.stride(0))
    assert rc == 0
    y = y_wide[:, 4:4 + n]
    assert _error(y, _quantized(x.contiguous(), 16), weight, bias) <= TOLERANCE
    assert (y_wide[:, :4] == 7).all() and (y_wide[:, 4 + n:] == 7).all()
    assert torch.equal(native.qgemm_i8(x, weight, bias), y)


@pytest.mark.parametrize("rows", [1, 5, 67])
def test_fused_silu_is_silu_mul_of_the_product(rows: int) -> None:
    """silu: W = gate | up (48 rows each: a pair and a tail of the halves' panels), y =
    `native.silu_mul` of the unfused product with its bias, bit for bit."""
    types = (quant.Q4_K, quant.Q8_0, quant.Q5_0, quant.Q4_1)
    weight = random_weight(types, (32, 16, 24, 24), 512, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 512, generator=gen), torch.randn(96, generator=gen)
    fused = native.qgemm_i8(x, weight, bias, silu=True)
    assert fused.shape == (rows, 48)
    assert torch.equal(fused, native.silu_mul(native.qgemm_i8(x, weight, bias)))


def test_zero_rows_of_x_give_the_bias() -> None:
    weight = random_weight((quant.Q4_0,), (32,), 256)
    x = torch.zeros(3, 256)
    x[1, 40] = 2.0  # one group of one row nonzero: the others scale by 0, not by nan
    bias = torch.randn(32)
    y = native.qgemm_i8(x, weight, bias)
    assert torch.equal(y[0], bias) and torch.equal(y[2], bias)
    assert _error(y, _quantized(x, 32), weight, bias) <= TOLERANCE


def test_what_it_refuses() -> None:
    """F16 / BF16 parts (no codes), silu of rows not a multiple of 32, x of another K."""
    rng = np.random.default_rng(0)
    for other in (quant.F16, quant.BF16):
        weight = QuantWeight.build([random_part(quant.Q8_0, 8, 64, rng),
                                    random_part(other, 8, 64, rng)], 64)
        assert not native.qgemm_i8_fits(weight)
        with pytest.raises(ValueError, match="qgemm_i8"):
            native.qgemm_i8(torch.randn(2, 64), weight)
        y = torch.empty(2, 16)
        assert build.loaded().plait_qgemm_i8(torch.randn(2, 64).data_ptr(), 2, 64,
                                             weight.desc.data_ptr(), 64, None, 0,
                                             y.data_ptr(), 16) == SHAPES
    weight = random_weight((quant.Q4_0,), (48,), 64)
    assert native.qgemm_i8_fits(weight)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.qgemm_i8(torch.randn(2, 64), weight, silu=True)
    with pytest.raises(ValueError, match="does not fit"):
        native.qgemm_i8(torch.randn(2, 96), weight)
    assert native.qgemm_i8(torch.randn(0, 64), weight).shape == (0, 48)


def test_a_build_without_vnni_has_no_qgemm_i8(tmp_path) -> None:
    lib = library_without_avx512vnni(tmp_path)
    weight = random_weight((quant.Q4_0,), (32,), 64)
    x, y = torch.randn(2, 64), torch.empty(2, 32)
    assert lib.plait_has_qgemm_i8() == 0
    assert lib.plait_qgemm_i8(x.data_ptr(), 2, 64, weight.desc.data_ptr(), 64, None, 0,
                              y.data_ptr(), 32) == SHAPES
