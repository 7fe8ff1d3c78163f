"""Repacked weights (kernels/cpu/repack.py, repack.c): the product against a float64
product of the same int8-quantized x (quantized here by the rule the kernel states) with
gguf-py's dequantized weights, tight enough that the unquantized x fails it; against the
float product within the activation rounding's bound; the plain C kernel's bits equal the
AVX512-VNNI kernel's, at decode sizes and through the prefill rungs (repack_wide.h;
repack_amx.h's AMX-INT8 tiles where the process has them) at every type's threshold and
past it; embedding rows dequantized from the tiles are gguf-py's bits; the repacked bytes
stay within 1.05x the file's; builds without VNNI or AMX, and PLAIT_REPACK_AMX=0, report
and refuse what they lack."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.native_builds import library_without_amx, library_without_avx512vnni
from helpers.quant_cases import random_part, random_weight

from plait.kernels.cpu import build, quant, repack
from plait.kernels.cpu.quant import QuantWeight, dequantize_reference

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels not built")
SHAPES = build.ABI.constants["PLAIT_ERR_SHAPES"]

TYPES = sorted(repack.REPACKED_TYPES)
# |y - x_q @ W^T - bias| per element relative to sum |x_q| |w| (+ |bias|): float32 sums of
# exact int32 dot products (measured ~1e-7); x unquantized is off by ~1e-3.
TOLERANCE = 1e-6


def _quantized(x: torch.Tensor) -> torch.Tensor:  # [M, K] float64
    """x as the kernel quantizes it: per 32, amax = max |x|, q = round-half-even(x * (127 /
    amax)) in float32 (0 where amax is 0), x_q = q * (amax / 127)."""
    rows, k = x.shape
    xg = x.view(rows, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv)
    assert q.abs().max() <= 127
    return (q.double() * (amax / 127.0).double()).view(rows, k)


def _error(y: torch.Tensor, xd: torch.Tensor, w: torch.Tensor,
           bias: torch.Tensor | None = None) -> float:
    """max |y - (xd @ w^T + bias)| relative to |xd| @ |w|^T + |bias|, in float64."""
    w = w.double()
    want, scale = xd @ w.T, xd.abs() @ w.abs().T
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    return ((y.double() - want).abs() / (scale + 1e-30)).max().item()


def _rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [M, N] float64
    """sum_g (sx_g / 2) sum_{k in g} |w_nk|: the most x's rounding to int8 can move y."""
    rows, k = x.shape
    half_step = x.view(rows, k // 32, 32).abs().amax(-1).double() / 127.0 / 2  # [M, G]
    wabs = w.double().abs().view(w.shape[0], k // 32, 32).sum(-1)  # [N, G]
    return half_step @ wabs.T


@pytest.mark.parametrize("ggml_type", TYPES, ids=quant.type_name)
def test_embedding_rows_are_gguf_bits(ggml_type: int) -> None:
    """37 rows (two tiles and a tail of 5) of K = 512, all rows and a shuffled subset."""
    weight = random_weight((ggml_type,), (37,), 512, seed=ggml_type)
    packed = repack.repack(weight)
    want = dequantize_reference(weight)
    assert torch.equal(repack.repack_dequantize(packed), want)
    rows = torch.tensor([36, 0, 17, 17, 31, 32, 5])
    assert torch.equal(repack.repack_dequantize(packed, rows), want[rows])


@pytest.mark.parametrize("ggml_type", TYPES, ids=quant.type_name)
@pytest.mark.parametrize("k", [512, 1536])
def test_product_of_every_type(ggml_type: int, k: int) -> None:
    """M = 1, 2, 3, 8, 9, 17 (register tiles of 8 and their tails), N = 37: the result is
    the int8-quantized x's product (tight), within the rounding bound of x's, and not x's."""
    weight = random_weight((ggml_type,), (37,), k, seed=ggml_type + k)
    packed, w = repack.repack(weight), dequantize_reference(weight)
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 2, 3, 8, 9, 17):
        x = torch.randn(rows, k, generator=gen)
        y = repack.repack_gemm(x, packed)
        assert y.shape == (rows, 37)
        assert _error(y, _quantized(x), w) <= TOLERANCE
        exact = x.double() @ w.double().T
        slack = TOLERANCE * (x.double().abs() @ w.double().abs().T)
        assert ((y.double() - exact).abs() <= _rounding_bound(x, w) + slack).all()
    assert _error(y, x.double(), w) > 10 * TOLERANCE


@pytest.mark.parametrize("ggml_type", TYPES, ids=quant.type_name)
def test_plain_c_kernel_gives_the_same_bits(ggml_type: int) -> None:
    """N = 21 (one unit of two tiles, the second of 5 columns), 4 rows (the two tiles
    together against 4 rows) and 5 and 11 (each tile alone against 8 rows at a time)."""
    if repack.isa() == repack.ISA_C:
        pytest.skip("this build's fastest kernel is the plain C one")
    weight = random_weight((ggml_type,), (21,), 512, seed=3 * ggml_type)
    packed = repack.repack(weight)
    gen = torch.Generator().manual_seed(ggml_type)
    bias = torch.randn(21, generator=gen)
    for rows in (4, 5, 11):
        x = torch.randn(rows, 512, generator=gen)
        fast = repack.repack_gemm(x, packed, bias)
        assert torch.equal(repack.repack_gemm(x, packed, bias, repack.ISA_C), fast), rows


def test_mixed_parts_bias_and_strides() -> None:
    """Parts of five types (rows 5, 16, 3, 20, 9: tiles that end inside a part), K = 768, a
    bias, x rows inside wider rows: each part's columns from its own tiles."""
    types = (quant.Q6_K, quant.Q4_K, quant.Q5_K, quant.Q8_0, quant.Q4_1)
    weight = random_weight(types, (5, 16, 3, 20, 9), 768, seed=7)
    packed, w = repack.repack(weight), dequantize_reference(weight)
    gen = torch.Generator().manual_seed(7)
    wide, bias = torch.randn(6, 768 + 40, generator=gen), torch.randn(53, generator=gen)
    x = wide[:, 16:16 + 768]
    y = repack.repack_gemm(x, packed, bias)
    assert _error(y, _quantized(x.contiguous()), w, bias) <= TOLERANCE
    assert torch.equal(repack.repack_gemm(x.contiguous(), packed, bias), y)
    assert torch.equal(repack.repack_dequantize(packed), w)


def test_zero_groups_of_x_give_the_bias() -> None:
    weight = random_weight((quant.Q4_K,), (32,), 256)
    packed, w = repack.repack(weight), dequantize_reference(weight)
    x = torch.zeros(3, 256)
    x[1, 40] = 2.0  # one group of one row nonzero: the others scale by 0, not by nan
    bias = torch.randn(32)
    y = repack.repack_gemm(x, packed, bias)
    assert torch.equal(y[0], bias) and torch.equal(y[2], bias)
    assert _error(y, _quantized(x), w, bias) <= TOLERANCE


@pytest.mark.parametrize("ggml_type", TYPES, ids=quant.type_name)
def test_repacked_bytes_within_five_percent_of_the_file(ggml_type: int) -> None:
    """896 rows of K = 4864 (Qwen2.5-0.5B's down projection): 1.0x the file's bytes, Q4_K
    and Q5_K 1.028x and 1.023x (their 6-bit scales kept as bytes)."""
    rng = np.random.default_rng(0)
    part = random_part(ggml_type, 896, 4864, rng)
    packed = repack.repack(QuantWeight.build([part], 4864))
    ratio = packed.nbytes / part.data.numel()
    assert ratio == pytest.approx({quant.Q4_K: 2368 / 2304, quant.Q5_K: 2880 / 2816}
                                  .get(ggml_type, 1.0))
    assert ratio <= 1.05


def test_what_it_refuses() -> None:
    rng = np.random.default_rng(0)
    mixed = QuantWeight.build([random_part(quant.Q8_0, 8, 64, rng),
                               random_part(quant.F16, 8, 64, rng)], 64)
    assert not repack.repackable(mixed)
    with pytest.raises(ValueError, match="not repacked"):
        repack.repack(mixed)
    packed = repack.repack(random_weight((quant.Q4_0,), (48,), 64))
    with pytest.raises(ValueError, match="does not fit"):
        repack.repack_gemm(torch.randn(2, 96), packed)
    with pytest.raises(ValueError, match="bias"):
        repack.repack_gemm(torch.randn(2, 64), packed, torch.zeros(47))
    with pytest.raises(ValueError, match="isa"):
        repack.repack_gemm(torch.randn(2, 64), packed, kernel_isa=7)
    with pytest.raises(ValueError, match="repack_dequantize"):
        repack.repack_dequantize(packed, torch.tensor([48]))
    assert repack.repack_gemm(torch.randn(0, 64), packed).shape == (0, 48)


@pytest.mark.parametrize("build_without, reported, refused, rows", [
    (library_without_avx512vnni, repack.ISA_C, repack.ISA_VNNI512, 2),
    (library_without_amx, repack.ISA_VNNI512, repack.ISA_AMX, 40),  # the wide rung's rows
], ids=["without-vnni", "without-amx"])
def test_a_build_without_an_isa_reports_the_one_below(tmp_path, build_without, reported,
                                                      refused, rows) -> None:
    """Where the CPU or compiler lacks AVX512-VNNI the build reports the plain C kernel (the
    engine's `--numerics auto` is then exact: engine/numerics.py), where it lacks AMX-INT8
    the VNNI one (and its AMX state is "absent"); either refuses the kernel above what it
    reports, and its own product of the repacked layout is still the plain C bits."""
    lib = build_without(tmp_path)
    assert lib.plait_repack_isa() == reported
    assert lib.plait_repack_amx_state() == repack.AMX_ABSENT  # no AMX code in either build
    weight = random_weight((quant.Q4_0,), (32,), 64)
    packed = repack.repack(weight)
    x, y = torch.randn(rows, 64), torch.empty(rows, 32)
    assert lib.plait_repack_gemm(x.data_ptr(), rows, 64, packed.desc.data_ptr(), 64, None,
                                 y.data_ptr(), 32, refused) == SHAPES
    assert lib.plait_repack_gemm(x.data_ptr(), rows, 64, packed.desc.data_ptr(), 64, None,
                                 y.data_ptr(), 32, reported) == 0
    assert torch.equal(y, repack.repack_gemm(x, packed, kernel_isa=repack.ISA_C))


# x rows around each type's prefill rung (repack_wide.h's wd_min_rows: Q6_K 24, Q5_0 / Q5_K
# 128; the 4-bit types and Q8_0 never) and past it, ragged against the register tiles.
RUNG_ROWS = (7, 8, 12, 13, 23, 24, 31, 37, 67, 127, 128, 133)


@pytest.mark.parametrize("ggml_type", TYPES, ids=quant.type_name)
@pytest.mark.parametrize("n", [37, 53])
def test_prefill_rung_gives_the_plain_c_bits(ggml_type: int, n: int) -> None:
    """K = 1280 (40 groups: scratch chunks of 16, 16 and 8), N = 37 (a last unit of one
    tile of 5 columns) or 53 (a last unit of two tiles, 21 columns), a bias: from M = 7 up,
    the rows that take the rung give c_tile's bits (the plain C kernel) and the quantized
    x's product, through the VNNI kernel (its wide rung) and the process's fastest."""
    if repack.isa() == repack.ISA_C:
        pytest.skip("this build's fastest kernel is the plain C one")
    weight = random_weight((ggml_type,), (n,), 1280, seed=5 * ggml_type + n)
    packed, w = repack.repack(weight), dequantize_reference(weight)
    gen = torch.Generator().manual_seed(n)
    bias = torch.randn(n, generator=gen)
    for rows in RUNG_ROWS:
        x = torch.randn(rows, 1280, generator=gen)
        y = repack.repack_gemm(x, packed, bias)
        assert torch.equal(y, repack.repack_gemm(x, packed, bias, repack.ISA_C)), rows
        assert torch.equal(y, repack.repack_gemm(x, packed, bias, repack.ISA_VNNI512)), rows
        assert _error(y, _quantized(x), w, bias) <= TOLERANCE
        assert torch.equal(repack.repack_gemm(x[:3], packed, bias), y[:3])  # decode rung


def test_prefill_rung_with_mixed_parts_and_strides() -> None:
    """Parts whose types take the rung from different M (Q6_K 24, Q5_0 128, Q4_K and Q8_0
    never), K = 768, x rows inside wider rows, a bias: at M = 16 none takes it, at M = 24
    the Q6_K part, at M = 130 the Q5_0 part too; each part's columns are the plain C
    kernel's bits."""
    if repack.isa() == repack.ISA_C:
        pytest.skip("this build's fastest kernel is the plain C one")
    types = (quant.Q6_K, quant.Q5_0, quant.Q8_0, quant.Q4_K)
    weight = random_weight(types, (20, 16, 9, 35), 768, seed=11)
    packed, w = repack.repack(weight), dequantize_reference(weight)
    gen = torch.Generator().manual_seed(11)
    bias = torch.randn(80, generator=gen)
    for rows in (16, 24, 130):
        wide = torch.randn(rows, 768 + 24, generator=gen)
        x = wide[:, 8:8 + 768]
        y = repack.repack_gemm(x, packed, bias)
        assert torch.equal(y, repack.repack_gemm(x.contiguous(), packed, bias, repack.ISA_C))
        assert _error(y, _quantized(x.contiguous()), w, bias) <= TOLERANCE


def test_prefill_rung_zero_rows_give_the_bias() -> None:
    """40 rows (the rung for Q6_K), all zero but one group of one row: the others are the
    bias exactly (their groups scale by 0, not by nan)."""
    packed = repack.repack(random_weight((quant.Q6_K,), (48,), 512, seed=2))
    x = torch.zeros(40, 512)
    x[17, 300] = -1.5
    bias = torch.randn(48, generator=torch.Generator().manual_seed(2))
    y = repack.repack_gemm(x, packed, bias)
    assert torch.equal(y[:17], bias.expand(17, 48)) and torch.equal(y[18:], bias.expand(22, 48))
    assert not torch.equal(y[17], bias)


needs_amx = pytest.mark.skipif(repack.isa() != repack.ISA_AMX,
                               reason="no AMX-INT8 tiles in this build or process")
# The AMX rung's thresholds (repack_amx.h's am_min_rows: Q4_0 / Q5_0 32, Q4_1 / Q8_0 / Q4_K /
# Q5_K 48, Q6_K never: the wide rung) and rows past them, ragged against its 16-row A tiles.
AMX_ROWS = (31, 32, 33, 47, 48, 49, 64, 83)


@needs_amx
@pytest.mark.parametrize("ggml_type", TYPES, ids=quant.type_name)
@pytest.mark.parametrize("n, k", [(37, 1280), (53, 4352)])
def test_amx_rung_gives_the_plain_c_bits(ggml_type: int, n: int, k: int) -> None:
    """N = 37 (a last unit of one tile of 5 columns) or 53 (two tiles, 21 columns), K =
    1280 (40 groups: one chunk) or 4352 (136: chunks of 46, 46 and 44, batches of 4 that
    end ragged), a bias: every M around and past the type's threshold gives c_tile's bits
    exactly (the plain C kernel; the VNNI kernel below the threshold) and the quantized x's
    product."""
    weight = random_weight((ggml_type,), (n,), k, seed=7 * ggml_type + n)
    packed, w = repack.repack(weight), dequantize_reference(weight)
    gen = torch.Generator().manual_seed(k + n)
    bias = torch.randn(n, generator=gen)
    for rows in AMX_ROWS:
        x = torch.randn(rows, k, generator=gen)
        y = repack.repack_gemm(x, packed, bias, repack.ISA_AMX)
        assert torch.equal(y, repack.repack_gemm(x, packed, bias, repack.ISA_C)), rows
        assert torch.equal(y, repack.repack_gemm(x, packed, bias, repack.ISA_VNNI512)), rows
        assert _error(y, _quantized(x), w, bias) <= TOLERANCE


@needs_amx
def test_amx_rung_with_mixed_parts_strides_and_zero_rows() -> None:
    """Parts whose types take the AMX rung from different M (Q4_0 32, Q8_0 48, Q6_K never),
    K = 768, x rows inside wider rows, a bias, rows of zeros: at M = 40 only the Q4_0 part
    takes it, at M = 70 the Q8_0 part too; each part's columns are the plain C kernel's
    bits, and a zero row is the bias exactly."""
    types = (quant.Q6_K, quant.Q4_0, quant.Q8_0, quant.Q4_1)
    weight = random_weight(types, (20, 16, 9, 35), 768, seed=13)
    packed, w = repack.repack(weight), dequantize_reference(weight)
    gen = torch.Generator().manual_seed(13)
    bias = torch.randn(80, generator=gen)
    for rows in (40, 70):
        wide = torch.randn(rows, 768 + 24, generator=gen)
        wide[rows - 3] = 0.0
        x = wide[:, 8:8 + 768]
        y = repack.repack_gemm(x, packed, bias, repack.ISA_AMX)
        assert torch.equal(y, repack.repack_gemm(x.contiguous(), packed, bias, repack.ISA_C))
        assert _error(y, _quantized(x.contiguous()), w, bias) <= TOLERANCE
        assert torch.equal(y[rows - 3], bias)


@needs_amx
def test_amx_off_by_environment() -> None:
    """PLAIT_REPACK_AMX=0: the process reports the VNNI kernel, the product row is named
    after it, and the AMX kernel is refused (the engine's products log then says
    repacked/avx512-vnni, and why the AMX rung is unused)."""
    code = ("import torch\n"
            "from plait.kernels.cpu import quant, repack\n"
            "from plait.kernels.cpu.products import repacked_row\n"
            "part = quant.QuantPart(torch.zeros(32, 34, dtype=torch.uint8), quant.Q8_0, 32)\n"
            "packed = repack.repack(quant.QuantWeight.build([part], 32))\n"
            "refused = False\n"
            "try:\n"
            "    repack.repack_gemm(torch.ones(64, 32), packed, kernel_isa=repack.ISA_AMX)\n"
            "except ValueError as error:\n"
            "    refused = 'kernel isa' in str(error)\n"
            "print(repack.isa(), repacked_row().name, refused, repack.amx_state())\n"
            "print(repack.amx_unused())\n")
    env = {**os.environ, "PLAIT_REPACK_AMX": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, check=True)
    first, second = done.stdout.splitlines()
    assert first.split() == [str(repack.ISA_VNNI512), "repacked/avx512-vnni", "True",
                             str(repack.AMX_OFF)]
    assert second == "off (PLAIT_REPACK_AMX=0 in the environment)"


def test_amx_state_matches_the_kernel() -> None:
    """amx_state says why isa() is or is not ISA_AMX: on where it is; absent in a build
    without the AMX code; otherwise off or a refusal by Linux, which amx_unused words."""
    state = repack.amx_state()
    assert (state == repack.AMX_ON) == (repack.isa() == repack.ISA_AMX)
    if state in (repack.AMX_ON, repack.AMX_ABSENT):
        assert repack.amx_unused() is None
    elif state < 0:
        assert repack.amx_unused() == (
            f"refused by Linux (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(-state)}); "
            "prefill runs the AVX512-VNNI kernels")
