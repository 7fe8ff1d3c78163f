"""The kept-i8 rows on the default GGUF: which products they send to `qgemm_i8`
(INT8_MIN_ROWS rows or more, weights they take) and the MLP's fused gate_up + silu_mul in
row chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.products import on_row
from helpers.quant_cases import random_part

from plait.engine.models import layers
from plait.engine.models.linear import Linear
from plait.kernels.cpu import build, native, products, quant
from plait.kernels.cpu.products import INT8_MIN_ROWS, ProductSettings, qgemm_max_rows
from plait.kernels.cpu.quant import QuantWeight, dequantize_reference

pytestmark = pytest.mark.skipif(not build.available() or not native.has_qgemm_i8(),
                                reason="no qgemm_i8 in this build (needs AVX512-VNNI)")


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_products_from_int8_min_rows(kept, compute_dtype: torch.dtype) -> None:
    src = kept.model.layers[0].self_attn.qkv_proj
    tag = "f32" if compute_dtype == torch.float32 else "bf16"
    assert ProductSettings(compute_dtype=compute_dtype, int8="prefill").choose(src.qweight) \
        is products.row(f"kept-i8/{tag}")
    linear = on_row(src, f"kept-i8/{tag}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(INT8_MIN_ROWS, linear.in_features, generator=gen)
    assert torch.equal(linear(x), native.qgemm_i8(x, src.qweight))
    few = x[:INT8_MIN_ROWS - 1]
    assert torch.equal(linear(few), native.qgemm(few, src.qweight, None, compute_dtype))
    big = torch.randn(qgemm_max_rows(compute_dtype) + 40, linear.in_features, generator=gen)
    out = linear(big)
    assert torch.equal(out, native.qgemm_i8(big, src.qweight))
    ref = big @ dequantize_reference(src.qweight).t()
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_weights_it_does_not_take_keep_their_path() -> None:
    rng = np.random.default_rng(0)
    weight = QuantWeight.build([random_part(quant.BF16, 32, 64, rng)], 64)
    linear = Linear.kept(weight)
    assert not products.row("kept-i8/f32").takes(weight)
    assert ProductSettings(int8="prefill").choose(weight) is products.row("kept/f32")
    x = torch.randn(INT8_MIN_ROWS + 1, 64)
    torch.testing.assert_close(linear(x), x @ dequantize_reference(weight).t())


def test_mlp_fuses_silu_in_row_chunks(kept, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200-row MLP in chunks (the byte cap lowered: chunks of at most INT8_MIN_ROWS rows):
    every row's result is the unchunked int8 MLP's, bit for bit; with gate_up alone on the
    kept-i8 row the MLP keeps its ordinary path (gate_up's product, then silu_mul, unfused)."""
    model = kept.model
    src = model.layers[0].mlp
    x = torch.randn(200, src.gate_up_proj.in_features, generator=torch.Generator().manual_seed(2))
    plain = src(x)
    mlp = layers.MLP(model.config, model.ops)
    mlp.gate_up_proj, mlp.down_proj = on_row(src.gate_up_proj, "kept-i8/f32"), src.down_proj
    gate_up = mlp.gate_up_proj
    assert torch.equal(mlp(x), src.down_proj(native.silu_mul(native.qgemm_i8(x, gate_up.qweight))))
    mlp.down_proj = down = on_row(src.down_proj, "kept-i8/f32")
    whole = native.qgemm_i8(native.silu_mul(native.qgemm_i8(x, gate_up.qweight)), down.qweight)
    monkeypatch.setattr(products, "MLP_CHUNK_BYTES", 4 * gate_up.out_features)  # -> the minimum
    cats: list[int] = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts: cats.append(len(ts)) or real_cat(ts))
    out = mlp(x)
    assert cats == [-(-200 // INT8_MIN_ROWS)] and torch.equal(out, whole)
    assert (out - plain).abs().max() <= 0.05 * plain.abs().max()
