"""A bfloat16 prefill product's rows padded to a multiple of 16 (kernels/cpu/dequantized.py
`padded_rows`): the padding is zeros, only bf16 products of PAD_FROM_ROWS rows or more get
it, and the caller sees exactly its own rows, equal to the unpadded product's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.quant_cases import random_weight

from plait.kernels.cpu import dequantized, native, quant
from plait.kernels.cpu.dequantized import (
    PAD_FROM_ROWS,
    PAD_ROWS,
    matmul_dequantized,
    padded_rows,
)

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")


def test_padded_rows_are_zeros_after_x() -> None:
    x = torch.randn(533, 64, generator=torch.Generator().manual_seed(0))
    out = padded_rows(x, BF16)
    assert out.shape == (544, 64) and out.dtype == BF16 and out.is_contiguous()
    assert torch.equal(out[:533].view(torch.int16), x.to(BF16).view(torch.int16))
    assert not out[533:].view(torch.int16).any()  # +0.0 bits


@pytest.mark.parametrize(("rows", "dtype"), [
    (PAD_FROM_ROWS - 1, BF16),  # too few rows to pad
    (2 * PAD_ROWS * 17, BF16),  # a multiple already
    (533, torch.float32),  # float32 products are never padded
])
def test_rows_left_as_they_are(rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    out = padded_rows(x, dtype)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, x.to(dtype))


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("widen", [True, False])
def test_padded_product_is_the_unpadded_one(monkeypatch, chunked: bool, widen: bool) -> None:
    """533 rows (padded to 544) against the same call with padding off: the same rows, bf16
    products within one bf16 rounding of each other (oneDNN may block K differently for
    other row counts), in the whole weight and in row chunks, with a bias."""
    weight = random_weight((quant.Q4_K, quant.Q8_0), (40, 23), 512, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(533, 512, generator=gen)
    bias = torch.randn(weight.out_features, generator=gen)
    scratch = 16 * 512 * 2 if chunked else dequantized.SCRATCH_BYTES
    padded = matmul_dequantized(x, weight, bias, BF16, {}, scratch, widen)
    monkeypatch.setattr(dequantized, "PAD_FROM_ROWS", 1 << 30)
    plain = matmul_dequantized(x, weight, bias, BF16, {}, scratch, widen)
    assert padded.shape == plain.shape == (533, 63) and padded.is_contiguous()
    assert padded.dtype == plain.dtype == (torch.float32 if widen else BF16)
    ref = x.to(BF16).double() @ native.dequantize(weight, None, BF16).double().t()
    ref += bias.double()
    bound = 2.0 ** -7 * ref.abs() + 1e-3 * ref.abs().max()
    for out in (padded, plain):
        assert ((out.double() - ref).abs() <= bound).all()
    np.testing.assert_allclose(padded.float().numpy(), plain.float().numpy(), rtol=2 ** -7,
                               atol=1e-3 * float(ref.abs().max()))
