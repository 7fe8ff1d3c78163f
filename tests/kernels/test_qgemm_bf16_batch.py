"""bfloat16 compute in `native.qgemm` (kernels/cpu/qgemm_batch_bf16.h): a descriptor flagged
PLAIT_QGEMM_BF16 (`QuantWeight.desc_bf16`) multiplies, from `quant.BF16_MIN_ROWS` rows, x and
the dequantized W each rounded to bfloat16 (nearest even), in float32 sums. Checked against a
float64 matmul of those rounded operands, for every type kept native, up to 24 rows, K of 1,
2 and 7 K blocks, parts, bias and strides; the tolerance is tight enough that the float32
(unrounded) product fails it. Fewer rows and K % 32 != 0 keep the float32 paths, bit for
bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.native_builds import library_without_avx512bf16
from helpers.quant_cases import (
    ALL_TYPES,
    BLOCK_32_TYPES,
    MIXED_PARTS,
    MIXED_SIZES,
    K,
    qgemm_in_wide_buffers,
    random_part,
    random_weight,
)

from plait.kernels.cpu import build, native, quant
from plait.kernels.cpu.quant import QuantWeight

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")

SHAPES = build.ABI.constants["PLAIT_ERR_SHAPES"]
BF16 = torch.bfloat16
# |y - bf16(x) @ bf16(W)^T| per element, relative to sum(|x| |w|) (+ |bias|): float32 sums
# of exact products over K <= 6400 in 16 lanes and K blocks stay near 1e-8 (measured); an x
# or W left unrounded, or rounded another way than to nearest even, is off by ~1e-4.
TOLERANCE = 2e-6


def _bf16_kernel_built() -> bool:
    """Whether this build has the bf16 batch path (AVX512-BF16): without it, flagged
    descriptors compute as float32 (plait_cpu.h), which the bf16 checks would refuse."""
    x = torch.randn(quant.BF16_MIN_ROWS, 32, generator=torch.Generator().manual_seed(0))
    weight = random_weight((quant.Q8_0,), (4,), 32)
    return not torch.equal(native.qgemm(x, weight, None, BF16), native.qgemm(x, weight))


needs_bf16 = pytest.mark.skipif(not build.available() or not _bf16_kernel_built(),
                                reason="no AVX512-BF16 in this build: float32 compute")


def _error(y: torch.Tensor, x: torch.Tensor, weight: QuantWeight,
           bias: torch.Tensor | None = None) -> float:
    """The largest |y - bf16(x) @ bf16(W)^T - bias| relative to sum(|x||w|) + |bias|, in
    float64, W's bf16 rows those of `native.dequantize(weight, None, bfloat16)`."""
    xb = x.to(BF16).double()
    wb = native.dequantize(weight, None, BF16).double()
    want, scale = xb @ wb.T, xb.abs() @ wb.abs().T
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    return ((y.double() - want).abs() / (scale + 1e-30)).max().item()


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=quant.type_name)
def test_bf16_weights_are_the_rounded_reference(ggml_type: int) -> None:
    """The bf16 weights the reference uses: gguf-py's float32 values rounded to nearest
    even by torch (the kernel rounds its decoded float32 vectors the same way)."""
    weight = random_weight((ggml_type,), (37,), 512)
    assert torch.equal(native.dequantize(weight, None, BF16),
                       quant.dequantize_reference(weight).to(BF16))


@needs_bf16
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=quant.type_name)
def test_bf16_chunk_words_are_dequantize_bf16(ggml_type: int) -> None:
    """The decoded chunk's bfloat16 words (group tables or decode_group then rounding) are
    `native.dequantize(weight, None, bfloat16)`'s, bit for bit but a zero's sign (which a
    sum of products does not keep): x the identity (K rows of one 1.0 each), so y[k, n] is
    1 x w[n, k], exact, plus zeros. Weights span the K types' sub-blocks and 37 rows (chunks
    of 16 and a tail)."""
    k = 512
    weight = random_weight((ggml_type,), (37,), k, seed=ggml_type)
    want = native.dequantize(weight, None, BF16)
    got = native.qgemm(torch.eye(k), weight, None, BF16)
    assert got.dtype == torch.float32 and torch.equal(got.T.to(BF16).float(), got.T)
    assert torch.equal(got.T.to(BF16), want)


@needs_bf16
@pytest.mark.parametrize(("ggml_type", "k"), [
    *((t, k) for t in ALL_TYPES for k in (512, 6400)),
    *((t, 1408) for t in BLOCK_32_TYPES)], ids=str)
def test_bf16_qgemm_of_every_row_count(ggml_type: int, k: int) -> None:
    """BF16_MIN_ROWS .. 24 rows (tiles of 4 rows and their tails), 37 weight rows (chunks of
    16 and a tail of 5), K in 1, 2 (1408) and 7 (6400) blocks; the float32 result is out of
    tolerance, so the check sees whether x and W were rounded."""
    weight = random_weight((ggml_type,), (37,), k)
    gen = torch.Generator().manual_seed(k)
    for rows in range(quant.BF16_MIN_ROWS, 25):
        x = torch.randn(rows, k, generator=gen)
        assert _error(native.qgemm(x, weight, None, BF16), x, weight) <= TOLERANCE, rows
    assert _error(native.qgemm(x, weight), x, weight) > 10 * TOLERANCE


@needs_bf16
@pytest.mark.parametrize(("types", "k"), MIXED_PARTS, ids=str)
@pytest.mark.parametrize("rows", [quant.BF16_MIN_ROWS, 7, 16, 24, 30])
def test_bf16_qgemm_of_parts_with_bias_and_strides(types: tuple[int, ...], k: int,
                                                    rows: int) -> None:
    """Parts of different types inside one 16-row chunk, a bias (added in float32), x and y
    rows inside wider buffers, the rest of y untouched; 30 rows: two passes over a chunk."""
    weight = random_weight(types, MIXED_SIZES[:len(types)], k, seed=rows)
    rc, x, bias, y, y_wide = qgemm_in_wide_buffers(weight, weight.desc_bf16, rows, seed=rows)
    assert rc == 0
    assert _error(y, x, weight, bias) <= TOLERANCE
    assert (y_wide[:, :4] == 7).all() and (y_wide[:, 4 + y.shape[1]:] == 7).all()
    assert torch.equal(native.qgemm(x, weight, bias, BF16), y)


def test_few_rows_and_short_rows_compute_as_float32() -> None:
    """Fewer than BF16_MIN_ROWS rows (one: the exact bf16-pieces path) and F16 / BF16 rows
    of K % 32 != 0 take the float32 paths whatever the descriptor says: the same bits."""
    weight = random_weight(tuple(ALL_TYPES), tuple(range(3, 3 + len(ALL_TYPES))))
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, quant.BF16_MIN_ROWS):
        x = torch.randn(rows, weight.in_features, generator=gen)
        assert torch.equal(native.qgemm(x, weight, None, BF16), native.qgemm(x, weight))
    rng = np.random.default_rng(2)
    short = QuantWeight.build([random_part(quant.F16, 5, 40, rng),
                               random_part(quant.BF16, 4, 40, rng)], 40)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(native.qgemm(x, short, None, BF16), native.qgemm(x, short))


def test_descriptors_and_flags() -> None:
    """`desc_bf16` is `desc` with the flag in its first word; `descriptor` picks by dtype;
    an unknown flag is refused; dequantize reads a flagged descriptor as its parts."""
    weight = random_weight((quant.Q4_0, quant.Q8_0), (3, 4))
    assert weight.desc_bf16[0] == weight.desc[0] | quant.BF16_COMPUTE
    assert torch.equal(weight.desc_bf16[1:], weight.desc[1:])
    assert weight.descriptor(torch.float32) is weight.desc
    assert weight.descriptor(BF16) is weight.desc_bf16
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        weight.descriptor(torch.float16)
    lib = build.loaded()
    x, y = torch.randn(2, 512), torch.empty(2, 7)
    bad = weight.desc.clone()
    bad[0] |= 8 * quant.BF16_COMPUTE  # (2x was the int8 panels' flag, 4x is the repacked one)
    assert lib.plait_qgemm(x.data_ptr(), 2, 512, bad.data_ptr(), 512, None, y.data_ptr(),
                           7) == SHAPES
    out = torch.empty(7, 512)
    assert lib.plait_dequantize(weight.desc_bf16.data_ptr(), 512, None, 7, out.data_ptr()) == 0
    assert torch.equal(out, native.dequantize(weight))


def test_a_build_without_avx512bf16_computes_float32(tmp_path) -> None:
    """`-mno-avx512bf16`: the kernels compile, and a flagged descriptor gives the unflagged
    one's bits (the float32 paths) at every row count."""
    lib = library_without_avx512bf16(tmp_path)
    weight = random_weight(tuple(ALL_TYPES), tuple(range(3, 3 + len(ALL_TYPES))))
    n, gen = weight.out_features, torch.Generator().manual_seed(5)
    for rows in (1, quant.BF16_MIN_ROWS, 16, 24):
        x = torch.randn(rows, K, generator=gen)
        ys = [torch.empty(rows, n), torch.empty(rows, n)]
        for y, desc in zip(ys, (weight.desc, weight.desc_bf16), strict=True):
            assert lib.plait_qgemm(x.data_ptr(), rows, K, desc.data_ptr(), K, None,
                                   y.data_ptr(), n) == 0
        assert torch.equal(ys[0], ys[1])
