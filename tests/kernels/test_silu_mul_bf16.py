"""`native.silu_mul` over bfloat16 (rowwise.c `plait_silu_mul_bf16`) and the MLP that feeds
it gate_up's bf16 product on the kept/bf16 row (engine/models/layers.py `MLP`, the row's
fused SiLU kernel): the same bits as the float32 kernel on the widened input, rounded to
nearest even."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.quant_cases import random_weight

from plait.engine.models.linear import Linear
from plait.engine.models.llama import MLP
from plait.kernels.cpu import native, quant
from plait.kernels.cpu.products import qgemm_max_rows, row

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, any NaN equal to any NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16),
                                                       b[~nan].view(torch.int16))


@pytest.mark.parametrize(("rows", "inter"), [(1, 7), (3, 40), (16, 24), (33, 4864)])
def test_bf16_silu_mul_is_the_float32_kernel_rounded(rows: int, inter: int) -> None:
    torch.manual_seed(rows)
    wide = (torch.randn(rows, 2 * inter + 6) * 6).bfloat16()  # a stride past 2 I
    wide[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    wide[-1, inter:inter + 2] = torch.tensor([-float("inf"), 1e-40])  # up: -inf, denormal
    gate_up = wide[:, :2 * inter]
    out = native.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, inter)
    expected = native.silu_mul(gate_up.float()).bfloat16()
    assert _same_bits(out, expected)
    truncated = (native.silu_mul(gate_up.float()).view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(out.view(torch.int16), truncated)  # it rounds, not truncates


def test_bf16_silu_mul_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit stride"):
        native.silu_mul(torch.zeros(8, 2, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"\[T, 2 I\]"):
        native.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))


def _mlp(compute_dtype: torch.dtype, hidden: int = 512, inter: int = 768) -> MLP:
    """An MLP whose projections are kept Q4_K / Q6_K weights on the kept row of
    `compute_dtype`."""
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=inter)
    mlp = MLP(cfg, SimpleNamespace())  # type: ignore[arg-type]
    name = "kept/bf16" if compute_dtype == torch.bfloat16 else "kept/f32"
    mlp.gate_up_proj = Linear.kept(random_weight((quant.Q4_K,), (2 * inter,), hidden, seed=1))
    mlp.down_proj = Linear.kept(random_weight((quant.Q6_K,), (hidden,), inter, seed=2))
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.select(row(name))
    return mlp


@pytest.mark.parametrize("extra", [1, 77])
def test_a_bf16_mlp_keeps_gate_up_in_bf16_with_the_float32_chains_bits(
        extra: int, monkeypatch) -> None:
    """Products past the quantized GEMM's rows (bf16 BLAS): gate_up's bf16 output goes to the
    bf16 silu_mul and on to down_proj, the float32 chain's bits."""
    mlp = _mlp(torch.bfloat16)
    x = torch.randn(qgemm_max_rows(torch.bfloat16) + extra, 512)
    widened = mlp.down_proj(native.silu_mul(mlp.gate_up_proj(x)))  # float32 between
    seen: list[torch.dtype] = []
    real = native.silu_mul
    monkeypatch.setattr(native, "silu_mul", lambda g: (seen.append(g.dtype), real(g))[1])
    out = mlp(x)
    assert seen == [torch.bfloat16]  # the bf16 chain ran
    assert out.dtype == torch.float32 and torch.equal(out, widened)


@pytest.mark.parametrize(("compute_dtype", "extra"),
                         [(torch.bfloat16, 0), (torch.float32, 0), (torch.float32, 1)])
def test_an_mlp_outside_bf16_blas_stays_float32(compute_dtype: torch.dtype, extra: int,
                                                monkeypatch) -> None:
    """The quantized GEMM's most rows (bf16 or float32) and float32 BLAS past them: silu_mul
    in float32."""
    rows = qgemm_max_rows(compute_dtype) + extra
    mlp = _mlp(compute_dtype)
    assert mlp.gate_up_proj.product.rung(rows).silu is None  # no fused kernel there
    seen: list[torch.dtype] = []
    real = native.silu_mul
    monkeypatch.setattr(native, "silu_mul", lambda g: (seen.append(g.dtype), real(g))[1])
    assert mlp(torch.randn(rows, 512)).dtype == torch.float32
    assert seen == [torch.float32]
