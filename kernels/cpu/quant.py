"""Weights kept in their file's format on CPU: GGML block types, as a GGUF file stores them.

A `QuantWeight` is a linear layer's W [N, K] (torch's [out, in]) as parts stacked along N.
A fused projection whose pieces the file stores in different types (Qwen2.5's Q4_K_M file
has q|k in Q5_0 and v in Q8_0 in half its layers) is one weight of several parts. Each part
holds `rows` rows, each row K / block_size blocks, byte for byte as in the file (a GGML
row is independent of the others, so rows can be reordered or stacked by copying bytes).

The C kernels read a weight through `desc`, int64 [1 + 3 * parts]:

    desc = [num_parts, addr_0, ggml_type_0, rows_0, addr_1, ggml_type_1, rows_1, ...]

`addr_i` is the address of part i's first byte; the tensors that own the bytes live in the
`QuantWeight`, which must outlive any use of `desc`. `desc_bf16` is the same descriptor with
`BF16_COMPUTE` OR-ed into its first word (plait_cpu.h's PLAIT_QGEMM_BF16): qgemm then computes
a product of `BF16_MIN_ROWS` or more rows in bfloat16 (x and W rounded to bf16, float32
sums; fewer rows as float32); `descriptor(compute_dtype)` picks one, so modules that share a
weight (a tied LM head and its embedding) may each compute in their own dtype.

Type ids are GGML's own (`gguf.GGMLQuantizationType`), so a tensor's type goes from the file
to the kernel unchanged. `dequantize_reference` is the float reference the kernels are
tested against: gguf-py's numpy dequantizer, the same code transformers uses to load GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from plait.kernels.cpu.build import ABI

# GGML type ids of the formats kept as they are (the C kernels compute from them); a file's
# other types are dequantized at load.
F16 = int(GGMLQuantizationType.F16)
BF16 = int(GGMLQuantizationType.BF16)
Q4_0 = int(GGMLQuantizationType.Q4_0)
Q4_1 = int(GGMLQuantizationType.Q4_1)
Q5_0 = int(GGMLQuantizationType.Q5_0)
Q8_0 = int(GGMLQuantizationType.Q8_0)
Q4_K = int(GGMLQuantizationType.Q4_K)
Q5_K = int(GGMLQuantizationType.Q5_K)
Q6_K = int(GGMLQuantizationType.Q6_K)
KEPT_TYPES: frozenset[int] = frozenset({F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K})
# The flag of a descriptor's first word that asks qgemm for bfloat16 compute.
BF16_COMPUTE: int = ABI.constants["PLAIT_QGEMM_BF16"]
# The fewest rows a product of a flagged descriptor computes in bfloat16.
BF16_MIN_ROWS: int = ABI.constants["PLAIT_QGEMM_BF16_MIN_ROWS"]


def type_name(ggml_type: int) -> str:
    return GGMLQuantizationType(ggml_type).name


def block_shape(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes of one row of K = `in_features` weights; K must be a whole number of blocks."""
    per_block, nbytes = block_shape(ggml_type)
    if in_features % per_block:
        raise ValueError(f"{type_name(ggml_type)} rows hold multiples of {per_block} weights, "
                         f"not {in_features}")
    return in_features // per_block * nbytes


@dataclass(frozen=True, slots=True)
class QuantPart:
    """`rows` rows of W in one GGML type: data uint8 [rows, row_bytes(type, K)], dense."""

    data: torch.Tensor
    ggml_type: int
    rows: int


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """W [out_features, in_features] as `parts` stacked along out_features (see the module
    docstring); `desc` (float32 compute) and `desc_bf16` (bfloat16 compute) are what the C
    kernels read."""

    parts: tuple[QuantPart, ...]
    in_features: int
    out_features: int
    desc: torch.Tensor  # int64 [1 + 3 * len(parts)]
    desc_bf16: torch.Tensor  # int64 [1 + 3 * len(parts)]: desc, first word | BF16_COMPUTE

    @staticmethod
    def build(parts: list[QuantPart] | tuple[QuantPart, ...], in_features: int) -> QuantWeight:
        """Check every part's bytes against its type and K, and write the descriptor."""
        if not parts:
            raise ValueError("a weight needs at least one part")
        flat: list[int] = [len(parts)]
        for part in parts:
            if part.ggml_type not in KEPT_TYPES:
                raise ValueError(f"type {type_name(part.ggml_type)} is not kept native")
            want = (part.rows, row_bytes(part.ggml_type, in_features))
            if part.data.dtype != torch.uint8 or tuple(part.data.shape) != want \
                    or not part.data.is_contiguous() or part.data.device.type != "cpu":
                raise ValueError(f"a {type_name(part.ggml_type)} part must be dense CPU uint8 "
                                 f"{list(want)}, not {part.data.dtype} "
                                 f"{list(part.data.shape)}")
            flat += [part.data.data_ptr(), part.ggml_type, part.rows]
        desc = torch.tensor(flat, dtype=torch.int64)
        desc_bf16 = desc.clone()
        desc_bf16[0] |= BF16_COMPUTE
        return QuantWeight(tuple(parts), in_features, sum(p.rows for p in parts), desc,
                           desc_bf16)

    def descriptor(self, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The descriptor for products in `compute_dtype`: `desc` for torch.float32 (exact),
        `desc_bf16` for torch.bfloat16."""
        if compute_dtype == torch.float32:
            return self.desc
        if compute_dtype == torch.bfloat16:
            return self.desc_bf16
        raise ValueError(f"compute dtype {compute_dtype} (float32 or bfloat16)")

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds in memory."""
        return sum(p.data.numel() for p in self.parts)

    def describe(self) -> str:
        """The part types, e.g. "Q5_0+Q5_0+Q8_0"."""
        return "+".join(type_name(p.ggml_type) for p in self.parts)


def dequantize_reference(weight: QuantWeight) -> torch.Tensor:  # float32 [N, K]
    """W in float32 through gguf-py's numpy dequantizer (slow; the tests' reference)."""
    rows = []
    for part in weight.parts:
        raw = part.data.numpy()
        values = dequantize(raw, GGMLQuantizationType(part.ggml_type))
        rows.append(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
                    .reshape(part.rows, weight.in_features))
    return torch.cat(rows, dim=0)


__all__ = ["BF16", "BF16_COMPUTE", "BF16_MIN_ROWS", "F16", "KEPT_TYPES", "Q4_0", "Q4_1",
           "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0", "QuantPart", "QuantWeight", "block_shape",
           "dequantize_reference", "row_bytes", "type_name"]
