"""The product table (kernels/cpu/products.py): every row, forced by name, against its
reference (float64 `F.linear` for the dense rows, x @ dequantize_reference(W)^T in float64
for the kept ones) at the row counts on both sides of each rung of its ladder; the fused
SiLU kernels against silu_mul of the product; which row the settings choose for which
weight; and `select_products`' log, one line per row."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.quant_cases import random_weight
from torch import nn

from plait.engine.models.linear import Linear, select_products
from plait.engine.numerics import resolve_numerics
from plait.kernels import AttentionShape, select_ops
from plait.kernels.cpu import build, native, quant
from plait.kernels.cpu.products import (
    BLAS,
    Product,
    ProductSettings,
    prompt_rows,
    qgemm_max_rows,
    row,
    table,
)
from plait.kernels.cpu.quant import QuantWeight, dequantize_reference

needs_native = pytest.mark.skipif(not build.available(), reason="native kernels not built")
USABLE = {"mkl": torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"),
          "onednn": torch.backends.mkldnn.is_available()}


def _rows_to_try(product: Product) -> list[int]:
    """1, and each rung's last row count and the next one (capped for speed)."""
    counts = {1}
    for rung in product.ladder:
        if rung.max_rows is not None:
            counts |= {rung.max_rows, rung.max_rows + 1}
    return sorted(c for c in counts if c <= 300)


def _dense_layer(bias: bool) -> Linear:
    layer = Linear(64, 80, bias=bias)
    assert layer.weight is not None
    nn.init.normal_(layer.weight)
    if layer.bias is not None:
        nn.init.normal_(layer.bias)
    return layer


def _kept_weight() -> QuantWeight:
    """gate | up of 2 x 48 rows in two types the repacked row takes, K = 512."""
    return random_weight((quant.Q4_K, quant.Q8_0), (48, 48), seed=7)


def _usable(name: str) -> bool:
    blas = name.removeprefix("panels/")
    return USABLE.get(blas, True) and name in table()


DENSE = ["torch", "mkl", "onednn", "panels/torch", "panels/mkl", "panels/onednn"]
# The repacked row is named after the process's kernel (avx512-vnni, avx512-vnni+amx); where
# the build has none, the name that is then skipped.
REPACKED = next((name for name in table() if name.startswith("repacked/")),
                "repacked/avx512-vnni")
KEPT = ["kept/f32", "kept/bf16", REPACKED]


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("bias", [False, True])
def test_dense_rows_equal_float64_linear(name: str, bias: bool) -> None:
    if name not in table() or not _usable(name):
        pytest.skip(f"row {name} not in this build")
    torch.manual_seed(0)
    layer = _dense_layer(bias)
    layer.select(row(name))
    assert layer.product.name == name
    for rows in [0, *_rows_to_try(layer.product)]:
        x = torch.randn(rows, 64)
        out = layer(x)
        assert out.shape == (rows, 80) and out.dtype == torch.float32
        expected = nn.functional.linear(x.double(), layer.weight.double(),
                                        None if layer.bias is None else layer.bias.double())
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)


@needs_native
@pytest.mark.parametrize("name", KEPT)
def test_kept_rows_equal_the_dequantized_product(name: str) -> None:
    """Exact rows within float32 summation noise; bf16 and int8 rungs within their
    rounding (bf16: x and W rounded; int8: x rounded per group)."""
    if not _usable(name):
        pytest.skip(f"row {name} not in this build (the repacked row needs AVX512-VNNI)")
    weight = _kept_weight()
    bias = torch.randn(weight.out_features, generator=torch.Generator().manual_seed(1))
    layer = Linear.kept(weight, bias)
    layer.select(row(name))
    dense = dequantize_reference(weight).double()
    gen = torch.Generator().manual_seed(2)
    exact = name == "kept/f32"
    for rows in [0, *_rows_to_try(layer.product)]:
        x = torch.randn(rows, weight.in_features, generator=gen)
        out = layer(x)
        assert out.shape == (rows, weight.out_features) and out.dtype == torch.float32
        ref = x.double() @ dense.t() + bias.double()
        if rows == 0:
            continue
        if exact or (rows == 1 and name == "kept/bf16"):  # one bf16 row stays exact
            # float32 summation noise over K = 512 products of random blocks
            noise = 1e-5 * float(ref.abs().max())
            torch.testing.assert_close(out.double(), ref, atol=noise, rtol=1e-5)
        else:
            assert (out.double() - ref).abs().max() <= 0.02 * ref.abs().max()


@needs_native
@pytest.mark.parametrize("name", KEPT)
def test_fused_silu_is_silu_mul_of_the_product(name: str) -> None:
    """Every rung's fused SiLU kernel (bf16 BLAS: the bits of the bf16 silu_mul of the
    product rounded to bf16; repacked: silu_mul of the product, prompt rows too, which
    take `repack.product_bf16_silu` where the process has AMX-BF16); a rung without one,
    silu_mul of its product."""
    if not _usable(name):
        pytest.skip(f"row {name} not in this build (the repacked row needs AVX512-VNNI)")
    weight = _kept_weight()
    layer = Linear.kept(weight)
    layer.select(row(name))
    gen = torch.Generator().manual_seed(3)
    fused_seen = 0
    for rows in _rows_to_try(layer.product):
        x = torch.randn(rows, weight.in_features, generator=gen)
        rung = layer.product.rung(rows)
        out = layer.silu_mul(x)
        if rung.silu is None:
            assert torch.equal(out, native.silu_mul(layer(x)))
            continue
        fused_seen += 1
        unfused = layer.silu_mul(x, fused=False)
        if out.dtype == torch.bfloat16:
            assert torch.equal(out.float(), unfused.bfloat16().float())
        else:
            assert torch.equal(out, unfused)
            with prompt_rows():
                assert torch.equal(layer.silu_mul(x), layer.silu_mul(x, fused=False))
    # the bf16 BLAS rung, and the repacked row's
    assert (fused_seen > 0) == (name == "kept/bf16" or name.startswith("repacked/"))


@needs_native
def test_settings_choose_rows_by_weight() -> None:
    dense = torch.zeros(8, 32)
    assert ProductSettings().choose(dense) is row("torch")
    assert ProductSettings("onednn", panels=True).choose(dense) is row("panels/onednn")
    assert ProductSettings("none", panels=True).choose(dense) is row("panels/torch")
    assert ProductSettings("onednn").choose(dense.double()) is row("torch")
    kept = _kept_weight()
    assert ProductSettings().choose(kept) is row("kept/f32")
    assert ProductSettings(compute_dtype=torch.bfloat16).choose(kept) is row("kept/bf16")
    half = random_weight((quant.BF16,), (32,), seed=1)  # not repacked
    settings = ProductSettings(compute_dtype=torch.bfloat16, repacked=True)
    assert settings.choose(half) is row("kept/bf16")
    assert settings.choose(kept) is (row(REPACKED) if REPACKED in table() else row("kept/bf16"))
    with pytest.raises(KeyError, match="no product row 'kept/f16'"):
        row("kept/f16")
    assert BLAS["none"] is row("torch")


@needs_native
def test_kept_ladders_hold_the_thresholds() -> None:
    qgemm = qgemm_max_rows(torch.float32)
    assert [r.max_rows for r in row("kept/f32").ladder] == [qgemm, None]
    assert [r.max_rows for r in row("kept/bf16").ladder] == \
        [quant.BF16_MIN_ROWS - 1, qgemm_max_rows(torch.bfloat16), None]
    assert [r.max_rows for r in row("panels/torch").ladder] == [build.NATIVE_MAX_ROWS, None]


def test_select_products_logs_one_line_per_row(caplog) -> None:
    """Every linear gets the row the engine's settings choose; one log line per row."""
    model = nn.Sequential(_dense_layer(True), _dense_layer(False), nn.Sequential(
        _dense_layer(False)))
    model.ops = select_ops(torch.device("cpu"), torch.float32, AttentionShape(4, 2, 16, 16),
                           cpu_gemm="none")
    with caplog.at_level(logging.INFO, logger="plait.engine"):
        chosen = select_products(model, resolve_numerics(
            "exact", torch.device("cpu"), torch.float32, model.ops.native, vnni=False))
    expected = "panels/torch" if model.ops.native else "torch"
    assert [p.name for p in chosen] == [expected] and len(chosen[row(expected)]) == 3
    lines = [r.message for r in caplog.records if r.message.startswith("products:")]
    assert lines == [f"products: {expected} for 3 linears (3 float32): "
                     f"{row(expected).describe()}"]
