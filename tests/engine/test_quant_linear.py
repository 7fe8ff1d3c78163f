"""A kept GGUF weight's products (the kept rows of kernels/cpu/products.py, the large rung
in kernels/cpu/dequantized.py) on the default model: against x @ dequantize_reference(W)^T
at decode, short and long prefill row counts, routed by row count between the quantized
GEMM and a dequantized copy for oneDNN, and the prefill path in row chunks that cut across
parts."""

from __future__ import annotations

import pytest
import torch
from helpers.kept import FUSED
from helpers.products import on_row

from plait.kernels.cpu import native
from plait.kernels.cpu.build import NATIVE_MAX_ROWS
from plait.kernels.cpu.dequantized import matmul_dequantized
from plait.kernels.cpu.products import QGEMM_MAX_ROWS, qgemm_max_rows
from plait.kernels.cpu.quant import BF16_MIN_ROWS, QuantWeight, dequantize_reference


@pytest.mark.parametrize("rows", [1, NATIVE_MAX_ROWS, QGEMM_MAX_ROWS[torch.float32],
                                  QGEMM_MAX_ROWS[torch.float32] + 9])
def test_quant_linear_equals_x_times_dequantized_weight(kept, rows) -> None:
    """Every format of the first and last layer, and the tied head, at decode, short and
    long prefill row counts (qgemm, then dequantized for oneDNN): x @
    dequantize_reference(W)^T (float64) within float32 summation noise."""
    gen = torch.Generator().manual_seed(rows)
    model = kept.model
    linears = [layer.get_submodule(n) for layer in (model.layers[0], model.layers[-1])
               for n in FUSED] + [model.lm_head]
    for linear in linears:
        x = torch.randn(rows, linear.in_features, generator=gen)
        ref = x.double() @ dequantize_reference(linear.qweight).double().t()
        out = linear(x)
        assert out.dtype == torch.float32 and out.is_contiguous()
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


def test_bf16_compute_of_large_products(kept) -> None:
    """compute_dtype bfloat16: a prefill-sized product as bf16 x bf16 (the kept weight's
    bf16 rounding, the output's), within bf16 error of the float product."""
    src = kept.model.layers[0].mlp.gate_up_proj
    linear = on_row(src, "kept/bf16")
    qgemm_rows = qgemm_max_rows(torch.bfloat16)
    x = torch.randn(qgemm_rows + 40, linear.in_features,
                    generator=torch.Generator().manual_seed(1))
    ref = x @ dequantize_reference(src.qweight).t()
    out = linear(x)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    # routed by row count: up to QGEMM_MAX_ROWS the quantized GEMM, past it oneDNN
    assert torch.equal(out, matmul_dequantized(x, src.qweight, None, torch.bfloat16))
    short = x[:qgemm_rows]
    assert torch.equal(linear(short), native.qgemm(short, src.qweight, None, torch.bfloat16))
    few = x[:BF16_MIN_ROWS - 1]  # decode rows below BF16_MIN_ROWS stay float32
    torch.testing.assert_close(linear(few), src(few))


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_large_products_in_row_chunks(kept, compute_dtype) -> None:
    """The prefill path in row chunks that cut across parts (a 100-row scratch over q|k|v|o
    stacked as one multi-part weight), with a bias: x @ dequantize_reference(W)^T + bias, as
    whole (float32: summation noise; bf16: bf16 error)."""
    layer = kept.model.layers[0].self_attn
    qweight = QuantWeight.build(layer.qkv_proj.qweight.parts + layer.o_proj.qweight.parts,
                                layer.o_proj.in_features)
    assert len(qweight.parts) >= 2
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(NATIVE_MAX_ROWS + 40, qweight.in_features, generator=gen)
    bias = torch.randn(qweight.out_features, generator=gen)
    ref = x.double() @ dequantize_reference(qweight).double().t() + bias.double()
    cache: dict = {}
    chunk_bytes = 100 * qweight.in_features * compute_dtype.itemsize
    out = matmul_dequantized(x, qweight, bias, compute_dtype, cache, scratch_bytes=chunk_bytes)
    chunks = cache["chunks", 100]
    assert [end - start for start, end, _ in chunks][:-1] == [100] * (len(chunks) - 1)
    assert any(len(part.parts) == 2 for _, _, part in chunks)  # a chunk spans two parts
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert out.shape == (x.shape[0], qweight.out_features)
    if compute_dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)
    else:
        assert (out.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    whole = matmul_dequantized(x, qweight, bias, compute_dtype)  # one chunk: the same numbers
    torch.testing.assert_close(out, whole, atol=1e-4, rtol=1e-5)
