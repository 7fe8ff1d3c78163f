"""The prompt rows' product of repacked weights (`repack.product_bf16`, AMX-BF16 tiles,
kernels/cpu/repack_amx_bf16.h): x and W's values rounded to bfloat16, float32 sums. Its
result against float64 over the same bfloat16 operands, every repacked type; each row's
bits independent of the other rows and of M; where it is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.quant_cases import random_weight

from plait.kernels.cpu import build, quant, repack

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels not built")
needs_bf16 = pytest.mark.skipif(not build.available() or not repack.prompt_bf16(),
                                reason="no AMX-BF16 in this build or process")

TYPES = sorted(repack.REPACKED_TYPES)
# |y - x_b @ w_b^T - bias| per element relative to |x_b| @ |w_b|^T + |bias| (float64, over
# x and the dequantized W rounded to bfloat16): float32 sums over K <= 1280 (measured
# ~2e-7), and a weight whose float32 value the kernel forms as one fused a c - o, where
# the dequantizer rounds twice, may land on the other side of a bfloat16 tie (2^-8 of that
# one term). A wrong pairing, scale or tile gives errors of 1e-2 and more.
TOLERANCE = 2e-5


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _error(y: torch.Tensor, x: torch.Tensor, packed: repack.RepackedWeight,
           bias: torch.Tensor | None) -> float:
    xb, wb = _bf16(x), _bf16(repack.repack_dequantize(packed))
    want, scale = xb @ wb.T, xb.abs() @ wb.abs().T
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    return ((y.double() - want).abs() / (scale + 1e-30)).max().item()


@needs_bf16
@pytest.mark.parametrize("ggml_type", TYPES, ids=quant.type_name)
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_product_of_every_type(ggml_type: int, rows: int) -> None:
    """37 columns (two tiles and a part of one), K of 5 blocks of 256, with a bias."""
    k = 1280
    packed = repack.repack(random_weight((ggml_type,), (37,), k, seed=ggml_type + rows))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(37, generator=gen)
    y = repack.product_bf16(x, packed.desc, k, 37, bias)
    assert y.shape == (rows, 37)
    assert _error(y, x, packed, bias) < TOLERANCE


@needs_bf16
def test_mixed_parts_and_strided_rows() -> None:
    """Parts of four types (one of 9 rows), x rows 2 K apart, no bias."""
    types = (quant.Q6_K, quant.Q4_K, quant.Q5_K, quant.Q8_0)
    weight = random_weight(types, (20, 16, 9, 35), 768, seed=11)
    packed = repack.repack(weight)
    x = torch.randn(23, 2 * 768, generator=torch.Generator().manual_seed(3))[:, :768]
    assert x.stride(0) == 2 * 768
    y = repack.product_bf16(x, packed.desc, 768, 80)
    assert _error(y, x, packed, None) < TOLERANCE


@needs_bf16
def test_a_rows_bits_do_not_depend_on_the_others() -> None:
    """Each row of a 50-row product is, bit for bit, that row alone and that row among 3
    (other row counts, other A tiles' padding, other row positions in a tile)."""
    k, n = 576, 70
    packed = repack.repack(random_weight((quant.Q4_1,), (n,), k, seed=4))
    x = torch.randn(50, k, generator=torch.Generator().manual_seed(5))
    whole = repack.product_bf16(x, packed.desc, k, n)
    for i in (0, 15, 16, 31, 32, 49):
        assert torch.equal(repack.product_bf16(x[i:i + 1], packed.desc, k, n)[0], whole[i])
        lo = max(0, i - 1)
        few = repack.product_bf16(x[lo:lo + 3], packed.desc, k, n)
        assert torch.equal(few[i - lo], whole[i])


@needs_bf16
def test_more_rows_than_a_block_are_the_rows_alone() -> None:
    """A product of more rows than the kernel takes in one block (AB_BLOCK_ROWS, 512, for
    K <= 2048), x rows strided, with a bias: each row (first, last, either side of a
    block's edge) is that row alone, bit for bit, and the whole within the tolerance."""
    k, n = 576, 40
    packed = repack.repack(random_weight((quant.Q4_1,), (n,), k, seed=6))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1100, 2 * k, generator=gen)[:, :k]
    bias = torch.randn(n, generator=gen)
    whole = repack.product_bf16(x, packed.desc, k, n, bias)
    assert _error(whole, x, packed, bias) < TOLERANCE
    for i in (0, 511, 512, 1023, 1024, 1099):
        alone = repack.product_bf16(x[i:i + 1], packed.desc, k, n, bias)
        assert torch.equal(alone[0], whole[i])


@needs_bf16
@pytest.mark.parametrize(("types", "rows", "m"), [
    ((quant.Q4_1, quant.Q4_1), (48, 48), 1),  # gate | up as two parts (SmolLM2's)
    ((quant.Q5_0, quant.Q5_0), (64, 64), 33),  # Qwen's
    ((quant.Q4_K, quant.Q6_K), (32, 32), 600),  # parts of two types; two blocks of rows
    ((quant.Q8_0,), (96,), 17),  # one part holding both halves
    ((quant.Q6_K, quant.Q4_K, quant.Q5_K), (16, 48, 32), 40),  # the halves across parts
])
def test_silu_fused_is_silu_mul_of_the_product(types, rows, m) -> None:
    """`product_bf16_silu` of a gate | up weight is, bit for bit, `native.silu_mul` of
    `product_bf16` (x rows strided), whatever the parts' types and boundaries on 16 rows."""
    from plait.kernels.cpu import native

    k, n = 512, sum(rows)
    packed = repack.repack(random_weight(types, rows, k, seed=n + m))
    x = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m))[:, :k]
    fused = repack.product_bf16_silu(x, packed.desc, k, n)
    assert fused.shape == (m, n // 2)
    assert torch.equal(fused, native.silu_mul(repack.product_bf16(x, packed.desc, k, n)))


@needs_bf16
def test_silu_fused_refusals() -> None:
    """Halves not whole tiles (N % 32), 16 rows of W in two parts: refused, as
    `silu_fusable` says beforehand (the products' fused rung asks it)."""
    odd = repack.repack(random_weight((quant.Q4_0,), (48,), 64))
    assert not repack.silu_fusable(odd.desc)
    with pytest.raises(ValueError, match="multiple of 16"):
        repack.product_bf16_silu(torch.zeros(2, 64), odd.desc, 64, 48)
    split = repack.repack(random_weight((quant.Q4_0, quant.Q4_0), (8, 56), 64))
    assert not repack.silu_fusable(split.desc)
    with pytest.raises(ValueError, match="product_bf16_silu"):
        repack.product_bf16_silu(torch.zeros(2, 64), split.desc, 64, 64)
    across = repack.repack(random_weight((quant.Q4_0, quant.Q4_0), (16, 48), 64))
    assert repack.silu_fusable(across.desc)


@needs_bf16
def test_zero_rows_and_shapes() -> None:
    """No rows: an empty result; x of the wrong width: ValueError."""
    packed = repack.repack(random_weight((quant.Q4_0,), (48,), 64))
    assert repack.product_bf16(torch.empty(0, 64), packed.desc, 64, 48).shape == (0, 48)
    with pytest.raises(ValueError, match="does not fit"):
        repack.product_bf16(torch.zeros(2, 32), packed.desc, 64, 48)


def test_off_with_the_amx_rung() -> None:
    """PLAIT_REPACK_AMX=0 turns it off with the AMX-INT8 rung: prompt_bf16() is False and a
    call is refused (in a process of its own: the answer is asked of the library once)."""
    code = ("import torch\n"
            "from plait.kernels.cpu import repack\n"
            "assert not repack.prompt_bf16()\n"
            "try:\n"
            "    repack.product_bf16(torch.zeros(1, 32), torch.zeros(4, dtype=torch.int64),"
            " 32, 16)\n"
            "except ValueError as e:\n"
            "    print('refused:', e)\n")
    env = dict(os.environ, PLAIT_REPACK_AMX="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused: repack product_bf16: this build or process has no AMX-BF16" in done.stdout


def test_state_matches_the_isa() -> None:
    """prompt_bf16() only where the AMX rung is on (it shares that rung's tile state)."""
    if repack.prompt_bf16():
        assert repack.isa() == repack.ISA_AMX
    if repack.isa() != repack.ISA_AMX:
        assert not repack.prompt_bf16()

