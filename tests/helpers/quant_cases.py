"""Random GGUF weights and the strided qgemm call the quant kernel tests share
(tests/kernels/test_quant_kernels.py, test_qgemm_bf16_batch.py)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from plait.kernels.cpu import build, quant
from plait.kernels.cpu.quant import QuantPart, QuantWeight

K = 512  # two super-blocks of 256, sixteen blocks of 32
# Byte offsets of each block type's fp16 fields (scale d, min m / dmin): random bytes there
# would be inf / nan, so they get finite random values.
FP16_FIELDS = {quant.Q4_0: (0,), quant.Q4_1: (0, 2), quant.Q5_0: (0,), quant.Q8_0: (0,),
               quant.Q4_K: (0, 2), quant.Q5_K: (0, 2), quant.Q6_K: (208,)}
# The types gguf-py can quantize (the others' blocks are random bytes only).
QUANTIZABLE = (quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q8_0, quant.BF16)
ALL_TYPES = sorted(quant.KEPT_TYPES)
# The types of blocks of 32 (or 1) weights: rows of any multiple of 32.
BLOCK_32_TYPES = [t for t in ALL_TYPES if quant.block_shape(t)[0] in (1, 32)]
# (types, K) of weights whose parts of different types meet inside one 16-row chunk, with
# the part sizes of `MIXED_SIZES`.
MIXED_PARTS = [((quant.Q4_1, quant.Q8_0, quant.Q5_0, quant.F16, quant.Q4_0, quant.BF16), 576),
               ((quant.Q6_K, quant.Q4_K, quant.Q5_K, quant.Q8_0), 768)]
MIXED_SIZES = (5, 16, 3, 20, 1, 7)


def random_part(ggml_type: int, rows: int, k: int, rng: np.random.Generator,
                quantized: bool = False) -> QuantPart:
    """`rows` rows of valid blocks: gguf-py's quantization of normal floats (`quantized`),
    else random bytes (every bit pattern of the quants) with finite random fp16 scales."""
    if ggml_type == quant.F16:
        raw = rng.standard_normal((rows, k)).astype(np.float16).view(np.uint8)
    elif ggml_type == quant.BF16 or quantized:
        raw = quantize(rng.standard_normal((rows, k)).astype(np.float32),
                       GGMLQuantizationType(ggml_type))
    else:
        per_block, nbytes = quant.block_shape(ggml_type)
        raw = rng.integers(0, 256, size=(rows, k // per_block, nbytes), dtype=np.uint8)
        for at in FP16_FIELDS[ggml_type]:
            scale = rng.uniform(-0.05, 0.05, size=(rows, k // per_block, 1)).astype(np.float16)
            raw[..., at:at + 2] = scale.view(np.uint8)
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1))
    return QuantPart(data, ggml_type, rows)


def random_weight(types: tuple[int, ...], rows: tuple[int, ...], k: int = K,
                  seed: int = 0) -> QuantWeight:
    """A weight of one random part per type, of `rows[i]` rows each, stacked."""
    rng = np.random.default_rng(seed)
    return QuantWeight.build([random_part(t, n, k, rng) for t, n in zip(types, rows,
                                                                        strict=True)], k)


def qgemm_in_wide_buffers(
    weight: QuantWeight, desc: torch.Tensor, rows: int, seed: int,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`plait_qgemm` of `desc` (one of `weight`'s descriptors) over `rows` random x rows
    that sit inside wider rows (ldx = K + 24), with a random bias, into y rows inside wider
    rows of 7.0 (4 before, 9 past). Returns (return code, x [rows, K], bias [N], y [rows, N]
    the written view, y_wide [rows, N + 13])."""
    k, n = weight.in_features, weight.out_features
    gen = torch.Generator().manual_seed(seed)
    wide_x, bias = torch.randn(rows, k + 24, generator=gen), torch.randn(n, generator=gen)
    x = wide_x[:, 8:8 + k]
    y_wide = torch.full((rows, n + 13), 7.0)
    rc = build.loaded().plait_qgemm(x.data_ptr(), rows, wide_x.stride(0), desc.data_ptr(), k,
                                    bias.data_ptr(), y_wide[:, 4:].data_ptr(),
                                    y_wide.stride(0))
    return rc, x, bias, y_wide[:, 4:4 + n], y_wide
