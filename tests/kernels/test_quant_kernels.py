"""The native kernels that compute from GGUF blocks (kernels/cpu/qgemm.c): `native.dequantize`
against gguf-py's dequantizer (`quant.dequantize_reference`) bit for bit, `native.qgemm`
against a float64 matmul of that reference, for every type kept native, on random valid
blocks and on the default model file's own tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from helpers.quant_cases import (
    ALL_TYPES,
    BLOCK_32_TYPES,
    MIXED_PARTS,
    MIXED_SIZES,
    QUANTIZABLE,
    K,
    qgemm_in_wide_buffers,
    random_part,
    random_weight,
)

from plait.engine.model_loader import default_gguf_path
from plait.kernels.cpu import build, native, quant
from plait.kernels.cpu.quant import QuantPart, QuantWeight

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")

SHAPES = build.ABI.constants["PLAIT_ERR_SHAPES"]
def _assert_gemm_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                       bias: torch.Tensor | None = None) -> None:
    """y against x @ w^T + bias in float64, each element within 1e-5 of its magnitude
    sum(|x| |w|) (float32 accumulation over K = 512 in any order stays far inside)."""
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        want += bias.double()
        scale += bias.double().abs()
    assert ((y.double() - want).abs() <= 1e-5 * scale + 1e-30).all()


# --- dequantize: gguf-py's bits ------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=quant.type_name)
def test_dequantize_is_the_reference_bit_for_bit(ggml_type: int) -> None:
    weight = random_weight((ggml_type,), (37,))
    ref = quant.dequantize_reference(weight)
    assert torch.isfinite(ref).all()
    assert torch.equal(native.dequantize(weight), ref)
    rows = torch.tensor([36, 0, 5, 5, 17])
    assert torch.equal(native.dequantize(weight, rows), ref[rows])


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=quant.type_name)
def test_dequantize_of_gguf_quantized_floats(ggml_type: int) -> None:
    rng = np.random.default_rng(1)
    weight = QuantWeight.build([random_part(ggml_type, 9, K, rng, quantized=True)], K)
    assert torch.equal(native.dequantize(weight), quant.dequantize_reference(weight))


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=quant.type_name)
def test_dequantize_to_bfloat16_rounds_the_float32_rows(ggml_type: int) -> None:
    weight = random_weight((ggml_type,), (13,))
    ref = quant.dequantize_reference(weight).to(torch.bfloat16)
    got = native.dequantize(weight, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16),
                                                       ref.view(torch.int16))
    rows = torch.tensor([12, 0, 3])
    assert torch.equal(native.dequantize(weight, rows, torch.bfloat16).view(torch.int16),
                       ref[rows].view(torch.int16))
    # an `out` two bytes off 64-byte alignment takes the float32 row then rounding, an
    # aligned one (above) the block decoder's rounding in registers: the same bits
    buf = torch.empty(ref.numel() + 1, dtype=torch.bfloat16)
    shifted = buf[1:].view(ref.shape)
    native.dequantize(weight, None, torch.bfloat16, out=shifted)
    assert torch.equal(shifted.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("copies", [1, 4])
def test_bfloat16_rounding_ties_and_nan(copies: int) -> None:
    """Round to nearest even on exact ties, and a NaN stays a NaN (F16 rows hold any bits);
    8 values (the float32 row's rounding) and 32 (K % 32 == 0: the block decoder's)."""
    # 1 + 2^-8 and 1 + 3 2^-8: ties between bfloat16 neighbours (to 1 and 1 + 2^-6, the
    # even ones); 1 + 5 2^-10, 1 + 3 2^-10: above, below a half; nan, -inf, the least
    # subnormal, -0
    halves = np.array([[0x3C04, 0x3C0C, 0x3C05, 0x3C03, 0x7E00, 0xFC00, 0x0001, 0x8000]],
                      dtype=np.uint16).repeat(copies, axis=1)
    part = QuantPart(torch.from_numpy(halves.view(np.uint8).copy()), quant.F16, 1)
    weight = QuantWeight.build([part], 8 * copies)
    ref = quant.dequantize_reference(weight)
    got = native.dequantize(weight, dtype=torch.bfloat16)
    nan = torch.arange(8 * copies) // copies == 4  # each value repeated `copies` times
    assert torch.isnan(got[0, nan]).all() and torch.isnan(ref[0, nan]).all()
    assert got[0, [0, copies]].tolist() == [1.0, 1.015625]
    keep = ~nan
    assert torch.equal(got[:, keep].view(torch.int16),
                       ref[:, keep].to(torch.bfloat16).view(torch.int16))


def test_dequantize_rows_across_parts() -> None:
    weight = random_weight((quant.Q5_0, quant.Q5_0, quant.Q8_0), (8, 8, 4))
    ref = quant.dequantize_reference(weight)
    rows = torch.tensor([19, 0, 8, 7, 16, 15])  # each part's edges
    assert torch.equal(native.dequantize(weight, rows), ref[rows])


# --- qgemm: x @ W^T ------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 16, 24, 40])
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=quant.type_name)
def test_qgemm_matches_a_float64_matmul(ggml_type: int, rows: int) -> None:
    weight = random_weight((ggml_type,), (45,))
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    _assert_gemm_close(native.qgemm(x, weight), x, quant.dequantize_reference(weight))


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_qgemm_of_several_parts_with_bias(rows: int) -> None:
    """q|k in Q5_0, v in Q8_0: Qwen2.5's Q4_K_M fused projection."""
    weight = random_weight((quant.Q5_0, quant.Q5_0, quant.Q8_0), (64, 16, 16))
    gen = torch.Generator().manual_seed(2)
    x, bias = torch.randn(rows, K, generator=gen), torch.randn(96, generator=gen)
    _assert_gemm_close(native.qgemm(x, weight, bias), x, quant.dequantize_reference(weight),
                       bias)


def test_qgemm_of_every_type_in_one_weight() -> None:
    types = tuple(ALL_TYPES)
    weight = random_weight(types, tuple(range(3, 3 + len(types))))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3))
    _assert_gemm_close(native.qgemm(x, weight), x, quant.dequantize_reference(weight))


def test_qgemm_reads_and_writes_strided_rows() -> None:
    """ldx, ldy: x rows inside a wider buffer, y rows written into a wider one, the rest of
    it untouched."""
    weight = random_weight((quant.Q4_1,), (33,))
    gen = torch.Generator().manual_seed(4)
    wide_x = torch.randn(20, K + 40, generator=gen)
    x = wide_x[:, 8:8 + K]
    y = torch.full((20, 50), 7.0)
    rc = build.loaded().plait_qgemm(x.data_ptr(), 20, wide_x.stride(0), weight.desc.data_ptr(),
                                    K, None, y[:, 3:].data_ptr(), y.stride(0))
    assert rc == 0
    _assert_gemm_close(y[:, 3:36], x, quant.dequantize_reference(weight))
    assert (y[:, :3] == 7).all() and (y[:, 36:] == 7).all()
    assert torch.equal(native.qgemm(x, weight), y[:, 3:36])


# --- qgemm of a batch of rows: weight rows decoded once into 16-row chunks, K in blocks ----
# (qgemm_batch.h): from 10 rows, or 8 of 12288 x floats (K = 6400: from 8 rows). K blocks of
# up to 32 groups, split evenly: K = 1408 two of 22 groups, K = 6400 seven, the last of 26;
# 37 weight rows: chunks of 16 and a tail of 5.


@pytest.mark.parametrize(("ggml_type", "k"), [
    *((t, k) for t in ALL_TYPES for k in (512, 6400)),
    *((t, 1408) for t in BLOCK_32_TYPES)], ids=str)
def test_batched_qgemm_of_every_row_count(ggml_type: int, k: int) -> None:
    weight = random_weight((ggml_type,), (37,), k)
    w = quant.dequantize_reference(weight)
    gen = torch.Generator().manual_seed(k)
    for rows in range(2, 25):
        x = torch.randn(rows, k, generator=gen)
        _assert_gemm_close(native.qgemm(x, weight), x, w)


@pytest.mark.parametrize(("types", "k"), MIXED_PARTS, ids=str)
@pytest.mark.parametrize("rows", [2, 12, 17, 24, 30])
def test_batched_qgemm_of_parts_with_bias_and_strides(types: tuple[int, ...], k: int,
                                                       rows: int) -> None:
    """Parts of different types meeting inside a 16-row chunk, a bias, x and y rows inside
    wider buffers (the rest of y untouched)."""
    weight = random_weight(types, MIXED_SIZES[:len(types)], k, seed=rows)
    rc, x, bias, y, y_wide = qgemm_in_wide_buffers(weight, weight.desc, rows, seed=rows)
    assert rc == 0
    _assert_gemm_close(y, x, quant.dequantize_reference(weight), bias)
    assert (y_wide[:, :4] == 7).all() and (y_wide[:, 4 + y.shape[1]:] == 7).all()


def test_f16_and_bf16_rows_of_any_length() -> None:
    """Block size 1: K need not be a multiple of the vector width (nor of 32: rows decoded
    into a float buffer rather than fused)."""
    for ggml_type in (quant.F16, quant.BF16):
        weight = random_weight((ggml_type,), (11,), k=37)
        ref = quant.dequantize_reference(weight)
        assert torch.equal(native.dequantize(weight), ref)
        for rows in (3, 40):  # 40: tiles of the float buffer path
            x = torch.randn(rows, 37, generator=torch.Generator().manual_seed(rows))
            _assert_gemm_close(native.qgemm(x, weight), x, ref)


def test_f32_panels_descriptor_is_plait_gemm_bit_for_bit() -> None:
    """The one-part F32 descriptor (what the decoder stack gets for a float32 model)."""
    gen = torch.Generator().manual_seed(6)
    w, x, bias = torch.randn(37, 72, generator=gen), torch.randn(5, 72, generator=gen), \
        torch.randn(37, generator=gen)
    panels = native.pack_weight(w)
    desc = native.panels_desc(panels, 37)
    y = torch.empty(5, 37)
    lib = build.loaded()
    assert lib.plait_qgemm(x.data_ptr(), 5, 72, desc.data_ptr(), 72, bias.data_ptr(),
                           y.data_ptr(), 37) == 0
    assert torch.equal(y, native.gemm(x, panels, 37, bias))
    out = torch.empty(37, 72)
    assert lib.plait_dequantize(desc.data_ptr(), 72, None, 37, out.data_ptr()) == 0
    assert torch.equal(out, w)


# --- refusals ------------------------------------------------------------------------------


def _desc(*parts: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor([len(parts), *(v for p in parts for v in p)], dtype=torch.int64)


def test_descriptors_the_kernels_cannot_read_are_refused() -> None:
    lib = build.loaded()
    weight = random_weight((quant.Q4_1,), (4,))
    addr = weight.parts[0].data.data_ptr()
    x, y = torch.zeros(2, K), torch.full((2, 4), 3.0)
    bad = [
        (_desc((addr, int(GGMLQuantizationType.Q2_K), 4)), K),  # a type not kept native
        (_desc((addr, 99, 4)), K),
        (_desc((addr, -3, 4)), K),  # outside the traits table
        (weight.desc, K - 16),  # K not a whole number of blocks
        (_desc((addr, quant.Q4_1, 4), (addr, 0, 4)), K),  # F32 panels beside another part
        (_desc((addr, quant.Q4_1, -1)), K),
        (torch.tensor([0], dtype=torch.int64), K),  # no part
        (_desc((0, quant.Q4_1, 4)), K),  # rows at address 0
    ]
    for desc, k in bad:
        assert lib.plait_qgemm(x.data_ptr(), 2, K, desc.data_ptr(), k, None, y.data_ptr(),
                               4) == SHAPES
        out = torch.full((4, K), 3.0)
        assert lib.plait_dequantize(desc.data_ptr(), k, None, 4, out.data_ptr()) == SHAPES
        assert (out == 3).all() and (y == 3).all()  # nothing written
    out = torch.full((1, K), 3.0)
    for row in (4, -1):
        rows = torch.tensor([row])
        assert lib.plait_dequantize(weight.desc.data_ptr(), K, rows.data_ptr(), 1,
                                    out.data_ptr()) == SHAPES
    assert (out == 3).all()
    with pytest.raises(ValueError, match="dequantize"):
        native.dequantize(weight, torch.tensor([4]))
    with pytest.raises(ValueError, match="qgemm"):
        native.qgemm(torch.zeros(2, K - 32), weight)


# --- the default model file's tensors ------------------------------------------------------


def _file_weight(reader: GGUFReader, name: str, num_rows: int | None = None) -> QuantWeight:
    tensor = next(t for t in reader.tensors if t.name == name)
    k, n = (int(v) for v in tensor.shape)
    data = np.asarray(tensor.data).reshape(n, -1)[:num_rows]
    part = QuantPart(torch.from_numpy(np.array(data)), int(tensor.tensor_type),
                     data.shape[0])
    return QuantWeight.build([part], k)


def test_the_default_models_q4_1_and_q8_0_tensors() -> None:
    path = default_gguf_path()
    if path is None or not Path(path).is_file():
        pytest.skip("the default GGUF file is not installed")
    reader = GGUFReader(path)
    gen = torch.Generator().manual_seed(7)
    for name, num_rows, ggml_type in (("blk.0.ffn_down.weight", None, quant.Q4_1),
                                      ("blk.3.attn_q.weight", None, quant.Q4_1),
                                      ("token_embd.weight", 2048, quant.Q8_0)):
        weight = _file_weight(reader, name, num_rows)
        assert weight.parts[0].ggml_type == ggml_type
        ref = quant.dequantize_reference(weight)
        assert torch.equal(native.dequantize(weight), ref), name
        token_ids = torch.tensor([1, weight.out_features - 1, 17, 1])
        assert torch.equal(native.dequantize(weight, token_ids), ref[token_ids])
        for rows in (1, 16, 40):
            x = torch.randn(rows, weight.in_features, generator=gen)
            _assert_gemm_close(native.qgemm(x, weight), x, ref)


# --- float32 activations, exactly: the bfloat16-pieces path (qgemm.c, split_row) ------------

BLOCK_TYPES = (quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q8_0, quant.Q4_K, quant.Q5_K,
               quant.Q6_K)


def _full_mantissa_x(rows: int, w: torch.Tensor, low_exp: int, high_exp: int,
                     seed: int) -> torch.Tensor:  # float32 [rows, K]
    """x whose every element uses all 24 significant bits (the low 8 set: a third bfloat16
    piece of ~2^-15 relative) at exponents in [low_exp, high_exp), its sign that of w's
    first row's weight, so that x . w row 0 adds no cancellation: an x rounded to 16 bits
    would be off by ~2^-16 of that sum, where float32 rounding leaves ~2^-24."""
    gen = torch.Generator().manual_seed(seed)
    k = w.shape[1]
    frac = torch.randint(0, 1 << 15, (rows, k), generator=gen) << 8 | 0xFF
    expo = torch.randint(low_exp, high_exp, (rows, k), generator=gen)
    mag = (1 + frac.double() / 2**23) * torch.pow(2.0, expo.double())
    sign = torch.where(w[0] < 0, -1.0, 1.0).double()
    return (mag * sign).float()


def _assert_float32_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          bias: torch.Tensor | None = None, rel: float = 1e-6) -> None:
    """y within `rel` of sum |x| |w| (+ |bias|) of the float64 x @ w^T + bias: float32 sums of
    exact products stay within a few 2^-24 of that; x cut to two bfloat16 pieces (16
    significant bits) would miss by ~1.5e-5 on _full_mantissa_x's rows."""
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        want += bias.double()
        scale += bias.double().abs()
    err = ((y.double() - want).abs() / (scale + 1e-300)).max().item()
    assert err <= rel, f"relative error {err:.3g}"


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=quant.type_name)
def test_qgemm_keeps_every_bit_of_float32_x(ggml_type: int, rows: int) -> None:
    """Every type at one row (a decode step) and a few, x over 2^-40 .. 2^40 with full
    mantissas: the result within float32 rounding of the float64 product."""
    weight = random_weight((ggml_type,), (21,), seed=rows)
    w = quant.dequantize_reference(weight)
    x = _full_mantissa_x(rows, w, -40, 40, seed=rows)
    _assert_float32_close(native.qgemm(x, weight), x, w)


@pytest.mark.parametrize("low_exp", [-100, 60])
def test_qgemm_keeps_tiny_and_huge_x(low_exp: int) -> None:
    """x near 2^-100 (its third piece near 2^-116, still a normal number) and near 2^60."""
    for ggml_type in BLOCK_TYPES:
        weight = random_weight((ggml_type,), (9,))
        w = quant.dequantize_reference(weight)
        x = _full_mantissa_x(1, w, low_exp, low_exp + 4, seed=8)
        _assert_float32_close(native.qgemm(x, weight), x, w)


@pytest.mark.parametrize("rows", [1, 3])
def test_qgemm_of_short_rows_with_bias_and_strides(rows: int) -> None:
    """K = 96 (three 32-weight blocks, no super-block), parts of three types, a bias, x rows
    inside a wider buffer and y rows written into a wider one (the rest untouched)."""
    k = 96
    rng = np.random.default_rng(9)
    parts = [random_part(t, n, k, rng) for t, n in ((quant.Q5_0, 10), (quant.Q8_0, 3),
                                                      (quant.Q4_1, 6), (quant.Q4_0, 5))]
    weight = QuantWeight.build(parts, k)
    w = quant.dequantize_reference(weight)
    wide_x = torch.zeros(rows, k + 24)
    wide_x[:, 5:5 + k] = _full_mantissa_x(rows, w, -8, 8, seed=10)
    x = wide_x[:, 5:5 + k]
    bias = torch.randn(24, generator=torch.Generator().manual_seed(11))
    y = torch.full((rows, 30), 7.0)
    rc = build.loaded().plait_qgemm(x.data_ptr(), rows, wide_x.stride(0),
                                    weight.desc.data_ptr(), k, bias.data_ptr(),
                                    y[:, 2:].data_ptr(), y.stride(0))
    assert rc == 0
    _assert_float32_close(y[:, 2:26], x, w, bias)
    assert (y[:, :2] == 7).all() and (y[:, 26:] == 7).all()


def test_qgemm_of_nonfinite_x() -> None:
    """inf and NaN in x give the float64 product's inf / NaN."""
    for ggml_type in BLOCK_TYPES:
        weight = random_weight((ggml_type,), (12,))
        w = quant.dequantize_reference(weight)
        x = torch.randn(3, K, generator=torch.Generator().manual_seed(12))
        x[0, 7], x[1, 300], x[2, 3] = float("inf"), float("-inf"), float("nan")
        y, want = native.qgemm(x, weight).double(), x.double() @ w.double().T
        assert torch.equal(y.isnan(), want.isnan()), quant.type_name(ggml_type)
        finite = ~want.isnan()
        assert torch.equal(y[finite].isinf(), want[finite].isinf())
        assert torch.equal(y[finite & want.isinf()], want[finite & want.isinf()])
