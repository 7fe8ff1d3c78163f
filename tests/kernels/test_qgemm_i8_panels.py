"""Resident int8 panels (`native.qgemm_i8_panels`, plait_qgemm_i8_pack; the engine's
`int8_panels`): their size and layout, products from them equal to `qgemm_i8`'s packing of
the blocks bit for bit (test_qgemm_i8.py checks those against float64), `qgemm`'s routing
of a descriptor flagged with panels by its row count, and what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.native_builds import library_without_avx512vnni
from helpers.quant_cases import MIXED_PARTS, random_part, random_weight

from plait.kernels.cpu import build, native, quant
from plait.kernels.cpu.quant import QuantWeight

pytestmark = pytest.mark.skipif(not build.available() or not native.has_qgemm_i8(),
                                reason="no qgemm_i8 in this build (needs AVX512-VNNI)")

SHAPES = build.ABI.constants["PLAIT_ERR_SHAPES"]


def _qgemm(x: torch.Tensor, weight: QuantWeight, desc: torch.Tensor) -> torch.Tensor:
    """plait_qgemm with a descriptor as the native decoder stack passes it."""
    y = torch.full((x.shape[0], weight.out_features), float("nan"))
    assert build.loaded().plait_qgemm(x.data_ptr(), x.shape[0], x.stride(0), desc.data_ptr(),
                                      weight.in_features, None, y.data_ptr(),
                                      weight.out_features) == 0
    return y


@pytest.mark.parametrize(("types", "rows", "k", "group"), [
    ((quant.Q8_0,), (37,), 512, 32), ((quant.Q6_K, quant.Q4_K), (16, 16), 512, 16)])
def test_size_and_layout(types, rows, k: int, group: int) -> None:
    """2 ceil(N / 32) panels (whole pairs: a last pair past N reads zeros, not past the
    end) of K / G groups, each [G / 4][16 rows][4 codes] then 16 float32 scales and 16
    offsets; checked byte for byte on Q8_0 (code q + 128, a = d, o = 128 d) and rows past
    N zero."""
    weight = random_weight(types, rows, k, seed=3)
    panels = native.qgemm_i8_panels(weight)
    n = weight.out_features
    assert panels.dtype == torch.uint8 and panels.data_ptr() % 64 == 0
    assert panels.numel() == 2 * -(-n // 32) * (k // group) * (16 * group + 128)
    if types != (quant.Q8_0,):
        return
    groups, gbytes = k // 32, 16 * 32 + 128
    blocks = weight.parts[0].data.view(n, groups, 34)
    d = blocks[:, :, :2].contiguous().view(torch.float16).float().view(n, groups)
    codes = (blocks[:, :, 2:].contiguous().view(torch.int8).int() + 128).view(n, groups, 32)
    for q in range(2 * -(-n // 32)):  # 37 rows: 16, 16, 5 and a panel of zeros
        panel = panels[q * groups * gbytes:(q + 1) * groups * gbytes].view(groups, gbytes)
        live = max(0, min(16, n - 16 * q))
        # [G / 4][16][4] -> [16 rows][G]
        got = panel[:, :512].view(groups, 8, 16, 4).permute(2, 0, 1, 3).reshape(16, groups, 32)
        assert torch.equal(got[:live].int(), codes[16 * q:16 * q + live])
        assert (got[live:] == 0).all()
        scales = panel[:, 512:].contiguous().view(torch.float32).view(groups, 2, 16)
        assert torch.equal(scales[:, 0, :live].t(), d[16 * q:16 * q + live])
        assert torch.equal(scales[:, 1, :live].t(), 128 * d[16 * q:16 * q + live])
        assert (scales[:, :, live:] == 0).all()


@pytest.mark.parametrize(("types", "k"), [((t,), 512) for t in sorted(native.I8_TYPES)]
                         + [(types[2:], k) for types, k in MIXED_PARTS[1:]], ids=str)
def test_products_from_panels_are_qgemm_i8s(types: tuple[int, ...], k: int) -> None:
    """1 .. 5, 16 and 67 x rows, 44 weight rows a part (a panel pair and a tail of 12),
    with a bias; and silu over a gate | up of whole panel pairs: the bits of qgemm_i8
    packing the same blocks."""
    weight = random_weight(types, (44,) * len(types), k, seed=len(types))
    panels = native.qgemm_i8_panels(weight)  # held: the descriptor holds only its address
    desc = native.i8_descriptor(weight, panels, 1)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(weight.out_features, generator=gen)
    for rows in (1, 2, 3, 4, 5, 16, 67):
        x = torch.randn(rows, k, generator=gen)
        assert torch.equal(native.qgemm_i8(x, weight, bias, desc=desc),
                           native.qgemm_i8(x, weight, bias))
    gate_up = random_weight(types[:1] * 2, (48, 48), k, seed=5)
    panels = native.qgemm_i8_panels(gate_up)
    desc = native.i8_descriptor(gate_up, panels, 1)
    x = torch.randn(6, k, generator=gen)
    assert torch.equal(native.qgemm_i8(x, gate_up, silu=True, desc=desc),
                       native.qgemm_i8(x, gate_up, silu=True))


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_qgemm_takes_the_panels_from_their_rows(compute_dtype: torch.dtype) -> None:
    """A flagged descriptor with 4 rows: 1 .. 3 x rows are qgemm's in `compute_dtype` (the
    unflagged descriptor's bits), 4 and more qgemm_i8's."""
    weight = random_weight((quant.Q4_K, quant.Q5_0), (32, 40), 256, seed=7)
    panels = native.qgemm_i8_panels(weight)
    desc = native.i8_descriptor(weight, panels, 4, compute_dtype)
    assert desc[0] == len(weight.parts) | native.I8_PANELS \
        | (quant.BF16_COMPUTE if compute_dtype == torch.bfloat16 else 0)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 4, 9):
        x = torch.randn(rows, 256, generator=gen)
        want = native.qgemm_i8(x, weight) if rows >= 4 \
            else native.qgemm(x, weight, None, compute_dtype)
        assert torch.equal(_qgemm(x, weight, desc), want)


def test_what_it_refuses(tmp_path) -> None:
    """Panels of F16 / BF16 parts; a flagged descriptor without panels or with fewer than 1
    row; a build without VNNI (no panels at all)."""
    rng = np.random.default_rng(0)
    for other in (quant.F16, quant.BF16):
        weight = QuantWeight.build([random_part(quant.Q8_0, 8, 64, rng),
                                    random_part(other, 8, 64, rng)], 64)
        with pytest.raises(ValueError, match="not read by qgemm_i8"):
            native.qgemm_i8_panels(weight)
        assert build.loaded().plait_qgemm_i8_panels_bytes(weight.desc.data_ptr(), 64) == SHAPES
    weight = random_weight((quant.Q4_0,), (32,), 64)
    panels = native.qgemm_i8_panels(weight)
    with pytest.raises(ValueError, match="at least 1"):
        native.i8_descriptor(weight, panels, 0)
    x, y = torch.randn(2, 64), torch.empty(2, 32)
    for address, rows in ((0, 1), (panels.data_ptr(), 0)):
        desc = torch.cat([weight.desc, torch.tensor([address, rows])])
        desc[0] |= native.I8_PANELS
        assert build.loaded().plait_qgemm(x.data_ptr(), 2, 64, desc.data_ptr(), 64, None,
                                          y.data_ptr(), 32) == SHAPES
        assert build.loaded().plait_qgemm_i8(x.data_ptr(), 2, 64, desc.data_ptr(), 64, None,
                                             0, y.data_ptr(), 32) == SHAPES
    lib = library_without_avx512vnni(tmp_path)
    assert lib.plait_qgemm_i8_panels_bytes(weight.desc.data_ptr(), 64) == SHAPES
    assert lib.plait_qgemm_i8_pack(weight.desc.data_ptr(), 64, panels.data_ptr()) == SHAPES
