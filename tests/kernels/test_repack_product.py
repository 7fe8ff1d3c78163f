"""The repacked row of the product table (kernels/cpu/products.py, `repacked/<isa>`): it
takes the kept weights of the repacked types and no others, the `repacked` setting
chooses it, its product is `repack.repack_gemm`'s bits, and so is `plait_qgemm`'s over
its flagged descriptor (what the native stack calls), its dequantized rows gguf-py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.quant_cases import random_part, random_weight

from plait.kernels.cpu import build, quant, repack
from plait.kernels.cpu.products import ProductSettings, repacked_row, row
from plait.kernels.cpu.quant import QuantWeight, dequantize_reference

pytestmark = pytest.mark.skipif(not build.available() or repack.isa() < repack.ISA_VNNI512,
                                reason="no AVX512-VNNI repacked kernel in this build")


def test_the_row_takes_repacked_types_only() -> None:
    """The row is named after the process's kernel: `repacked/avx512-vnni`, or
    `repacked/avx512-vnni+amx` where AMX-INT8 takes the prefill rows."""
    product = repacked_row()
    name = f"repacked/{repack.ISA_NAMES[repack.isa()]}"
    assert product is not None and product.name == name
    assert name in ("repacked/avx512-vnni", "repacked/avx512-vnni+amx")
    assert row(name) is product
    weight = random_weight((quant.Q4_K, quant.Q6_K), (16, 8), 512)
    rng = np.random.default_rng(0)
    half = QuantWeight.build([random_part(quant.BF16, 8, 512, rng)], 512)
    assert product.takes(weight) and not product.takes(half)
    assert not product.takes(torch.zeros(8, 512))
    settings = ProductSettings(repacked=True)
    assert settings.choose(weight) is product
    assert settings.choose(half).name == "kept/f32"
    assert ProductSettings().choose(weight).name == "kept/f32"


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_row_product_and_flagged_qgemm_are_repack_gemm(rows: int) -> None:
    """Parts of three types, a bias; the row's kernel, `plait_qgemm` of the flagged
    descriptor, and `repack_gemm` give the same bits."""
    weight = random_weight((quant.Q5_0, quant.Q8_0, quant.Q4_1), (32, 16, 21), 768, seed=rows)
    product = repacked_row()
    assert product is not None
    bias = torch.randn(69, generator=torch.Generator().manual_seed(rows))
    state = product.prepare(weight, bias)
    assert state.desc is not None and int(state.desc[0]) & repack.REPACKED_FLAG
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1))
    packed = repack.repack(weight)
    want = repack.repack_gemm(x, packed, bias)
    assert torch.equal(product(state, x), want)
    y = torch.empty(rows, 69)
    assert build.loaded().plait_qgemm(x.data_ptr(), rows, 768, state.desc.data_ptr(), 768,
                                      bias.data_ptr(), y.data_ptr(), 69) == 0
    assert torch.equal(y, want)
    stack = product.stack(state)
    assert stack is not None and stack.desc is state.desc and stack.tensors == (state.packed,)
    out = torch.empty(3, 768)
    ids = torch.tensor([68, 0, 40])
    assert build.loaded().plait_dequantize(state.desc.data_ptr(), 768, ids.data_ptr(), 3,
                                           out.data_ptr()) == 0
    assert torch.equal(out, dequantize_reference(weight)[ids])
