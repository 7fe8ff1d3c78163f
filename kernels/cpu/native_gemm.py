"""The native kernels' products (gemm.c, qgemm.c), each checking its tensors then
making one ctypes call: the kernels the product table's rows run (kernels/cpu/products.py).

* `gemm(x, panels, out_features, bias)`: x @ W^T for a few rows, W packed by
  `pack_weight`; streams the weights once (the decode step's GEMMs).
* `qgemm(x, weight, bias)`: x @ W^T for W kept in its GGUF block format (`quant.QuantWeight`),
  each block dequantized on the fly; `dequantize(weight, rows)`: rows of such a W in float32
  or bfloat16 (the embedding lookup, large-M prefill through BLAS, the tests).

Every function raises RuntimeError when the kernels are not available (`build.available()`).
"""

from __future__ import annotations

import torch

from plait.kernels.cpu.build import ABI, check_rc, loaded
from plait.kernels.cpu.quant import KEPT_TYPES, QuantWeight

# plait_cpu.h's type of a descriptor part holding float32 panels from `pack_weight`.
F32_PANELS = ABI.constants["PLAIT_GGML_F32"]
# The GGML types `qgemm` and `dequantize` read: every type quant.py keeps.
QUANT_TYPES: frozenset[int] = KEPT_TYPES


def lanes() -> int:
    """Floats per vector (and per weight panel) of the compiled kernels."""
    return loaded().plait_lanes()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [P, in, lanes]
    """`weight` as column panels for `gemm` (float32, padded with zeros to P * lanes rows)."""
    width = lanes()
    out_features, in_features = weight.shape
    panels = -(-out_features // width)
    padded = weight.new_zeros(panels * width, in_features, dtype=torch.float32)
    padded[:out_features] = weight
    return padded.view(panels, width, in_features).transpose(1, 2).contiguous()


def gemm(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    panels: torch.Tensor,  # [P, K, lanes] from `pack_weight`
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] float32, contiguous
) -> torch.Tensor:  # [M, out_features]
    """x @ W^T + bias, W the weight `panels` was packed from."""
    lib = loaded()
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    if panels.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"gemm: x {tuple(x.shape)} {x.dtype} does not fit panels "
                         f"{tuple(panels.shape)}")
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return y
    if bias is not None:
        bias = bias.contiguous()
    check_rc(lib.plait_gemm(x.data_ptr(), rows, x.stride(0), panels.data_ptr(), out_features, k,
                          None if bias is None else bias.data_ptr(), y.data_ptr(),
                          out_features), "gemm")
    return y


def panels_desc(panels: torch.Tensor, out_features: int) -> torch.Tensor:  # int64 [4]
    """The one-part descriptor of a weight packed by `pack_weight` ([P, K, lanes]), so that
    `qgemm` and the decoder stack take it like a quantized weight (plait_qgemm sends it to
    plait_gemm: the same bits as `gemm`). `panels` must outlive the descriptor's use."""
    if panels.dtype != torch.float32 or not panels.is_contiguous() \
            or panels.shape[0] * panels.shape[2] < out_features:
        raise ValueError(f"panels_desc: {tuple(panels.shape)} {panels.dtype} are not packed "
                         f"panels of {out_features} rows")
    return torch.tensor([1, panels.data_ptr(), F32_PANELS, out_features], dtype=torch.int64)


def _product_operands(
    kernel: str, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, cols: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A kept weight's product's checked operands: x with unit stride along K, the bias as
    float32 [N] contiguous (None: none), and y = empty [M, cols] float32. Raises ValueError
    (naming `kernel`) for an x that is not float32 CPU [M, K] or a bias that is not [N]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    if k != weight.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"{kernel}: x {tuple(x.shape)} {x.dtype} does not fit W "
                         f"[{weight.out_features}, {weight.in_features}] {weight.describe()}")
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
        if bias.shape != (weight.out_features,):
            raise ValueError(f"{kernel}: bias {tuple(bias.shape)}, W has "
                             f"{weight.out_features} rows")
    return x, bias, torch.empty(rows, cols, dtype=torch.float32)


def qgemm(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    weight: QuantWeight,  # W [N, K] in GGML blocks
    bias: torch.Tensor | None = None,  # [N] float32
    compute_dtype: torch.dtype = torch.float32,  # or torch.bfloat16
) -> torch.Tensor:  # [M, N] float32
    """x @ W^T + bias, each of W's blocks dequantized in registers. Any M; fastest for a
    decode step's few rows (W streams once in its compact form). float32 compute: float32
    activations, weights and accumulation (exact products; no activation quantization).
    bfloat16 compute (`weight.desc_bf16`), at `quant.BF16_MIN_ROWS` or more rows: x and the
    dequantized W rounded to bfloat16 (nearest even), float32 sums and bias; fewer rows, or
    a build without AVX512-BF16, compute as float32 (the same bits)."""
    lib = loaded()
    x, bias, y = _product_operands("qgemm", x, weight, bias, weight.out_features)
    rows, k = x.shape
    if rows == 0:
        return y
    desc = weight.descriptor(compute_dtype)
    check_rc(lib.plait_qgemm(x.data_ptr(), rows, x.stride(0), desc.data_ptr(), k,
                           None if bias is None else bias.data_ptr(), y.data_ptr(),
                           weight.out_features), "qgemm", f" ({weight.describe()})")
    return y


def dequantize(
    weight: QuantWeight,  # W [N, K] in GGML blocks
    rows: torch.Tensor | None = None,  # [R] integer row ids in [0, N); None: all N rows
    dtype: torch.dtype = torch.float32,  # or torch.bfloat16
    out: torch.Tensor | None = None,  # [R, K] of dtype, contiguous: written in place
) -> torch.Tensor:  # [R, K] (R = N without rows): `out` when given
    """Rows of W in float32, the same bits as `quant.dequantize_reference` (the embedding
    lookup takes token ids as rows); in bfloat16, those values rounded to nearest even (the
    bits of `.to(torch.bfloat16)` of the float32 rows). With `out` (a caller's reusable
    scratch) no tensor is allocated."""
    lib = loaded()
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize: dtype {dtype} (float32 or bfloat16)")
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    num_rows = weight.out_features if rows is None else rows.shape[0]
    if out is None:
        out = torch.empty(num_rows, weight.in_features, dtype=dtype)
    elif out.shape != (num_rows, weight.in_features) or out.dtype != dtype \
            or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"dequantize: out {tuple(out.shape)} {out.dtype} is not a contiguous "
                         f"CPU [{num_rows}, {weight.in_features}] {dtype}")
    if num_rows == 0:
        return out
    kernel = lib.plait_dequantize if dtype == torch.float32 else lib.plait_dequantize_bf16
    check_rc(kernel(weight.desc.data_ptr(), weight.in_features,
                  None if rows is None else rows.data_ptr(), num_rows, out.data_ptr()),
           "dequantize", f" ({weight.describe()}, rows in [0, {weight.out_features}))")
    return out


__all__ = ["F32_PANELS", "QUANT_TYPES", "dequantize", "gemm", "lanes", "pack_weight",
           "panels_desc", "qgemm"]
