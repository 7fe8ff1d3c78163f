"""silu(gate) * up in one pass with the int8 product (`repack.product_silu`, repack.c's
plait_repack_gemm_silu): bit for bit `native.silu_mul` of `repack.product`, through every
rung the product takes (the pair of tiles up to 4 rows, tiles of 8 rows, the wide rung from
a type's threshold, AMX-INT8 tiles where the process has them) and the plain C kernel;
what it refuses, as `silu_fusable` says beforehand."""

from __future__ import annotations

import pytest
import torch
from helpers.quant_cases import random_weight

from plait.kernels.cpu import build, native, quant, repack

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels not built")


def _isas() -> list[int]:
    """The plain C kernel and every faster one this build and process have."""
    return [isa for isa in sorted(repack.ISA_NAMES) if isa <= repack.isa()]


@pytest.mark.parametrize(("types", "rows"), [
    ((quant.Q4_1, quant.Q4_1), (48, 48)),  # gate | up as two parts (SmolLM2's)
    ((quant.Q5_0, quant.Q5_0), (32, 32)),  # Qwen-0.5B's: the wide rung from 128 rows
    ((quant.Q4_K, quant.Q6_K), (32, 32)),  # parts of two types (Q6_K's wide rung from 24)
    ((quant.Q8_0,), (64,)),  # one part holding both halves
    ((quant.Q6_K, quant.Q4_K, quant.Q5_K), (16, 48, 32)),  # the halves across parts
])
@pytest.mark.parametrize("m", [1, 3, 5, 8, 17, 33, 130])
def test_fused_is_silu_mul_of_the_product(types, rows, m) -> None:
    """Every kernel isa, x rows strided inside wider rows: `product_silu` equals
    `native.silu_mul(product(...))` exactly, at row counts on both sides of every rung's
    threshold, and its rows are those of the same call on fewer rows where the product's
    are (the first 3 rows through the pair rung)."""
    k, n = 512, sum(rows)
    packed = repack.repack(random_weight(types, rows, k, seed=n + m))
    x = torch.randn(m, k + 64, generator=torch.Generator().manual_seed(m))[:, 32:32 + k]
    for isa in _isas():
        fused = repack.product_silu(x, packed.desc, k, n, kernel_isa=isa)
        assert fused.shape == (m, n // 2)
        two_pass = native.silu_mul(repack.product(x, packed.desc, k, n, kernel_isa=isa))
        assert torch.equal(fused, two_pass), repack.ISA_NAMES[isa]
        few = repack.product_silu(x[:3], packed.desc, k, n, kernel_isa=isa)
        assert torch.equal(few, native.silu_mul(repack.product(x[:3], packed.desc, k, n,
                                                                kernel_isa=isa)))


def test_fused_values_are_silu_of_gate_times_up() -> None:
    """Against torch: silu(x W_gate^T) * (x W_up^T) of the product's own halves within
    float32 rounding of the silu (torch's exp and division differ in the last bits)."""
    k = 256
    packed = repack.repack(random_weight((quant.Q4_0, quant.Q4_0), (32, 32), k, seed=4))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    y = repack.product(x, packed.desc, k, 64)
    want = torch.nn.functional.silu(y[:, :32]) * y[:, 32:]
    torch.testing.assert_close(repack.product_silu(x, packed.desc, k, 64), want, rtol=1e-6,
                               atol=1e-6)


def test_zero_rows_give_zero() -> None:
    """x all zero: every product is 0 (its groups scale by 0, not by nan), so silu(0) * 0."""
    packed = repack.repack(random_weight((quant.Q4_1,), (64,), 128, seed=6))
    assert torch.equal(repack.product_silu(torch.zeros(40, 128), packed.desc, 128, 64),
                       torch.zeros(40, 32))


def test_refusals() -> None:
    """Halves not whole tiles (N % 32), 16 rows of W in two parts, a kernel isa past the
    build's: ValueError naming the kernel, and `silu_fusable` says so beforehand; a bias
    is refused by the C (PLAIT_ERR_SHAPES)."""
    odd = repack.repack(random_weight((quant.Q4_0,), (48,), 64))
    assert not repack.silu_fusable(odd.desc)
    with pytest.raises(ValueError, match="product_silu"):
        repack.product_silu(torch.zeros(2, 64), odd.desc, 64, 48)
    split = repack.repack(random_weight((quant.Q4_0, quant.Q4_0), (8, 56), 64))
    assert not repack.silu_fusable(split.desc)
    with pytest.raises(ValueError, match="product_silu"):
        repack.product_silu(torch.zeros(2, 64), split.desc, 64, 64)
    whole = repack.repack(random_weight((quant.Q4_0, quant.Q4_0), (16, 48), 64))
    assert repack.silu_fusable(whole.desc)
    with pytest.raises(ValueError, match="kernel isa"):
        repack.product_silu(torch.zeros(2, 64), whole.desc, 64, 64,
                            kernel_isa=max(repack.ISA_NAMES) + 1)
    x, act = torch.zeros(2, 64), torch.empty(2, 32)
    rc = build.loaded().plait_repack_gemm_silu(
        x.data_ptr(), 2, 64, whole.desc.data_ptr(), 64, torch.zeros(64).data_ptr(),
        act.data_ptr(), 32, repack.ISA_C)
    assert rc == build.ABI.constants["PLAIT_ERR_SHAPES"]
