"""The packed CPU GEMMs (engine/models/cpu_linear.py) against plain `F.linear` in float64:
every packing, every row count a step can have (the MKL pack is used for any number of
rows, not only its hint), bias or none, strided inputs; and the model-level choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.engine.models import cpu_linear
from plait.engine.models.cpu_linear import (
    cpu_vendor,
    default_packing,
    linear,
    prepack_cpu_linears,
)

AVAILABLE = [p for p in cpu_linear.PACKINGS
             if p == "none" or (p == "mkl" and torch.backends.mkl.is_available())
             or (p == "onednn" and torch.backends.mkldnn.is_available())]


@pytest.mark.parametrize("packing", AVAILABLE)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_plain_for_every_row_count(packing, bias) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias)
    model = nn.Sequential(layer)
    assert prepack_cpu_linears(model, packing) == packing
    assert (getattr(layer, "packed_weight", None) is None) == (packing == "none")
    for rows in (1, 2, 3, 7, 16, 17, 33, 128, 129, 300):
        x = torch.randn(rows, 96)
        expected = nn.functional.linear(x.double(), layer.weight.double(),
                                        None if layer.bias is None else layer.bias.double())
        out = linear(layer, x)
        assert out.shape == (rows, 200) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)
        strided = torch.randn(96, rows).t()  # a transposed view, as attention outputs can be
        torch.testing.assert_close(
            linear(layer, strided).double(),
            nn.functional.linear(strided.double(), layer.weight.double(),
                                 None if layer.bias is None else layer.bias.double()),
            rtol=0, atol=1e-4)


def test_packing_follows_the_weights_after_a_repack() -> None:
    """`prepack_cpu_linears` again after the weights change: the new weights are used."""
    layer = nn.Linear(32, 48, bias=False)
    prepack_cpu_linears(nn.Sequential(layer))
    with torch.no_grad():
        layer.weight.mul_(2)
    prepack_cpu_linears(nn.Sequential(layer))
    x = torch.randn(5, 32)
    torch.testing.assert_close(linear(layer, x), x @ layer.weight.t(), rtol=0, atol=1e-5)


def test_default_packing_and_its_override(monkeypatch) -> None:
    monkeypatch.delenv("PLAIT_CPU_GEMM", raising=False)
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "none"
    intel = "mkl" if torch.backends.mkl.is_available() else onednn
    assert default_packing("GenuineIntel") == intel
    assert default_packing("AuthenticAMD") == onednn
    assert default_packing("") == onednn
    assert default_packing() == default_packing(cpu_vendor())
    monkeypatch.setenv("PLAIT_CPU_GEMM", "None")
    assert default_packing("GenuineIntel") == "none"
    monkeypatch.setenv("PLAIT_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="PLAIT_CPU_GEMM must be one of mkl, onednn, none"):
        default_packing()


def test_only_float32_cpu_linears_are_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float64))
    prepack_cpu_linears(model, AVAILABLE[0])
    assert getattr(model[1], "packed_weight", None) is None
