"""The dense CPU rows of the product table (kernels/cpu/products.py: torch, mkl, onednn)
against plain `F.linear` in float64: every row, every row count a step can have (the MKL
pack is used for any number of rows, not only its hint), bias or none, strided inputs; the
selection the runner makes once at load; and the choice of BLAS."""

from __future__ import annotations

import pytest
import torch
from helpers.products import on_row
from torch import nn

from plait.engine.models.linear import Linear, apply_products, cpu_vendor, resolve_cpu_gemm
from plait.kernels.cpu import build
from plait.kernels.cpu.products import BLAS, ProductSettings

AVAILABLE = [name for name in BLAS
             if name == "none" or (name == "mkl" and torch.backends.mkl.is_available())
             or (name == "onednn" and torch.backends.mkldnn.is_available())]


def _linear(in_features: int, out_features: int, bias: bool) -> Linear:
    layer = Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight)
    if bias:
        nn.init.normal_(layer.bias)
    return layer


def _expected(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x.double(), layer.weight.double(),
                                None if layer.bias is None else layer.bias.double())


@pytest.mark.parametrize("name", AVAILABLE)
@pytest.mark.parametrize("bias", [False, True])
def test_every_format_equals_plain_for_every_row_count(name, bias) -> None:
    torch.manual_seed(0)
    plain = _linear(96, 200, bias)
    layer = on_row(plain, BLAS[name].name)
    assert layer.product is BLAS[name] and layer.weight is plain.weight \
        and layer.bias is plain.bias
    for rows in (0, 1, 2, 3, 7, 16, 17, 33, 128, 129, 300):
        x = torch.randn(rows, 96)
        out = layer(x)
        assert out.shape == (rows, 200) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), _expected(plain, x), rtol=0, atol=1e-4)
        strided = torch.randn(96, rows).t()  # a transposed view, as attention outputs can be
        torch.testing.assert_close(layer(strided).double(), _expected(plain, strided),
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", AVAILABLE)
def test_select_again_follows_the_weights(name) -> None:
    """`select` again after the weights change: the row packs the new weights."""
    layer = on_row(_linear(32, 48, bias=False), BLAS[name].name)
    with torch.no_grad():
        layer.weight.mul_(2)
    layer.select(layer.product)
    x = torch.randn(5, 32)
    torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=0, atol=1e-5)


def test_resolve_cpu_gemm() -> None:
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "none"
    intel = "mkl" if torch.backends.mkl.is_available() else onednn
    assert resolve_cpu_gemm("auto", "GenuineIntel") == intel
    assert resolve_cpu_gemm("auto", "AuthenticAMD") == onednn
    assert resolve_cpu_gemm("auto", "") == onednn
    assert resolve_cpu_gemm() == resolve_cpu_gemm("auto", cpu_vendor())
    assert resolve_cpu_gemm("none", "GenuineIntel") == "none"
    with pytest.raises(ValueError, match="cpu_gemm must be one of auto, mkl, onednn, none"):
        resolve_cpu_gemm("blas")


@pytest.mark.parametrize("panels", [False, True])
def test_apply_products_gives_float32_cpu_linears_their_row(panels) -> None:
    """Every float32 `Linear` of the tree gets its row once, over its own Parameters (a
    tied weight stays tied); other dtypes keep torch's GEMM; nothing else is touched."""
    if panels and not build.available():
        pytest.skip("native kernels unavailable: no panels")
    name = AVAILABLE[-1]
    tied = _linear(8, 16, bias=False)
    model = nn.Sequential(_linear(8, 8, bias=True), _linear(8, 8, bias=False).double(),
                          nn.Sequential(tied), nn.LayerNorm(8))
    embedding = nn.Embedding(16, 8)
    embedding.weight = tied.weight
    apply_products(model, ProductSettings(name, panels))
    expected = f"panels/{BLAS[name].name}" if panels else BLAS[name].name
    assert model[0].product.name == expected and model[2][0].product.name == expected
    assert model[1].product.name == "torch" and isinstance(model[3], nn.LayerNorm)
    assert model[2][0].weight is embedding.weight
    if panels:
        assert model[0].state.large.weight is model[0].weight
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x).double(), _expected(model[0], x), rtol=0,
                               atol=1e-5)

