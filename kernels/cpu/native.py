"""Python entry points of Plait's native CPU kernels (the C in this folder, loaded by
`build.py`): each checks its tensors, then makes one ctypes call.

* `gemm(x, panels, out_features, bias)`: x @ W^T for a few rows, W packed by
  `pack_weight`; streams the weights once (the decode step's GEMMs).
* `qgemm(x, weight, bias)`: x @ W^T for W kept in its GGUF block format (`quant.QuantWeight`),
  each block dequantized on the fly; `dequantize(weight, rows)`: rows of such a W in float32
  (the embedding lookup, large-M prefill through BLAS, the tests).
* `decode_attention(...)`: one query per sequence over its paged K/V, read in place; rows
  that share a prompt's blocks read them once (the CPU attention backend also feeds it
  prefill positions, in tiles).
* `rope_write_kv`, `add_rms_norm`, `silu_mul`: a layer's small per-row operations, one pass
  each; `sample_inverse_cdf`: the sampler's draw.
(The whole decoder stack in one call, `decoder.c`, is `stack.py`'s.)

Every function raises RuntimeError when the kernels are not available (`build.available()`).
"""

from __future__ import annotations

import functools

import torch

from plait.kernels.cpu.build import (
    ABI,
    MAX_BLOCK,
    MAX_HEAD_DIM,
    MAX_QUERIES,
    STACK_POINTERS,
    available,
    loaded,
)
from plait.kernels.cpu.quant import (
    KEPT_TYPES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    QuantWeight,
)

# plait_cpu.h's type of a descriptor part holding float32 panels from `pack_weight`.
F32_PANELS = ABI.constants["PLAIT_GGML_F32"]
# The GGML types `qgemm` and `dequantize` read: every type quant.py keeps.
QUANT_TYPES: frozenset[int] = KEPT_TYPES
# The block types `qgemm_i8` reads as codes with a scale and an offset per group (not F16 /
# BF16 rows: their values are no such codes).
I8_TYPES: frozenset[int] = frozenset({Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K})
# The flag of a descriptor's first word that says it carries resident int8 panels
# (plait_cpu.h's PLAIT_QGEMM_I8; `i8_descriptor`).
I8_PANELS: int = ABI.constants["PLAIT_QGEMM_I8"]
# The KV-cache element types the kernels write and read, as plait_cpu.h's PLAIT_KV_* codes:
# bfloat16 is rounded to nearest even when written, widened to float32 (exact) when read.
KV_DTYPES: dict[torch.dtype, int] = {torch.float32: ABI.constants["PLAIT_KV_F32"],
                                     torch.bfloat16: ABI.constants["PLAIT_KV_BF16"]}
# OR-ed into a bfloat16 cache's code for bfloat16 compute: the attention's shared tokens
# with bf16 dot products (plait_cpu.h's PLAIT_ATTN_BF16_DOT).
ATTN_BF16_DOT = ABI.constants["PLAIT_ATTN_BF16_DOT"]


def kv_caches_fit(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernels take this pair of caches: contiguous CPU tensors, both of one
    `KV_DTYPES` type."""
    return (k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES
            and k_cache.device.type == v_cache.device.type == "cpu"
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def kv_dtype_code(k_cache: torch.Tensor, v_cache: torch.Tensor,
                  compute_dtype: torch.dtype = torch.float32) -> int:
    """The attention's kv_dtype code for a pair of caches the kernels take (`kv_caches_fit`;
    ValueError otherwise): their PLAIT_KV_* code, with `ATTN_BF16_DOT` for bfloat16 caches
    and a `compute_dtype` of torch.bfloat16 (float32 caches compute in float32 whatever
    `compute_dtype` says)."""
    if not kv_caches_fit(k_cache, v_cache):
        raise ValueError(f"KV caches of {k_cache.dtype} / {v_cache.dtype}: the native kernels "
                         f"take contiguous CPU {' or '.join(map(str, KV_DTYPES))}, both alike")
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compute dtype {compute_dtype} (float32 or bfloat16)")
    code = KV_DTYPES[k_cache.dtype]
    if k_cache.dtype == compute_dtype == torch.bfloat16:
        code |= ATTN_BF16_DOT
    return code


def check_rc(rc: int, kernel: str, limits: str = "") -> None:
    """A kernel's return code (plait_cpu.h: 0 ok, -1 shapes refused, -2 out of memory) as
    an exception."""
    if rc == -2:
        raise MemoryError(f"native {kernel} could not allocate its buffers")
    if rc != 0:
        raise ValueError(f"{kernel}: shapes beyond the kernel's limits{limits}")


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


def has_qgemm_i8() -> bool:
    """Whether the loaded kernels were built with `qgemm_i8` (AVX512-VNNI, AVX512-BW/VL)."""
    return available() and bool(loaded().plait_has_qgemm_i8())


def qgemm_i8_fits(weight: QuantWeight) -> bool:
    """Whether `qgemm_i8` takes `weight`: every part of `I8_TYPES`, K a multiple of 32."""
    return weight.in_features % 32 == 0 and all(p.ggml_type in I8_TYPES for p in weight.parts)


def qgemm_i8(
    x: torch.Tensor,  # [M, K] float32 CPU, unit stride along K
    weight: QuantWeight,  # W [N, K], every part of I8_TYPES
    bias: torch.Tensor | None = None,  # [N] float32
    silu: bool = False,  # W = gate | up [2 I, K]: y = silu(gate) * up [M, I]
    desc: torch.Tensor | None = None,  # `i8_descriptor`'s, over `weight`: its panels
) -> torch.Tensor:  # [M, N] float32 ([M, N / 2] with silu)
    """x @ W^T + bias with x quantized to int8 per group of 32 (16 where a part is Q6_K):
    sx = max|x| / 127 and q = round(x / sx) per group (nearest even), then float32 sums of
    sx (a I - o S) per group, I the exact int32 dot product of q with the block's codes (W =
    a c - o per group), S the sum of q. W's values are the file's; x's rounding is the only
    difference from `qgemm`. `silu` (N % 32 == 0): `silu_mul` of that product, fused, the
    same bits. Needs `has_qgemm_i8()` and `qgemm_i8_fits(weight)`. With `desc` (W's resident
    panels) the kernel reads them instead of packing W's blocks: the same bits."""
    lib = loaded()
    if not qgemm_i8_fits(weight):
        raise ValueError(f"qgemm_i8: x {tuple(x.shape)} {x.dtype} does not fit W "
                         f"[{weight.out_features}, {weight.in_features}] {weight.describe()}")
    if silu and weight.out_features % 32:
        raise ValueError(f"qgemm_i8: silu needs gate | up rows of a multiple of 32, W has "
                         f"{weight.out_features}")
    cols = weight.out_features // 2 if silu else weight.out_features
    x, bias, y = _product_operands("qgemm_i8", x, weight, bias, cols)
    rows, k = x.shape
    if rows == 0:
        return y
    desc = weight.desc if desc is None else desc
    check_rc(lib.plait_qgemm_i8(x.data_ptr(), rows, x.stride(0), desc.data_ptr(), k,
                              None if bias is None else bias.data_ptr(), int(silu),
                              y.data_ptr(), cols), "qgemm_i8", f" ({weight.describe()})")
    return y


def qgemm_i8_panels(weight: QuantWeight) -> torch.Tensor:  # uint8 [bytes], 64-byte aligned
    """W's codes, scales and offsets packed once as `qgemm_i8` reads them (plait_cpu.h's
    plait_qgemm_i8_pack): 1.25 bytes a weight (1.5 where a part is Q6_K), kept beside the
    blocks for `i8_descriptor`. Needs `has_qgemm_i8()` and `qgemm_i8_fits(weight)`."""
    lib = loaded()
    if not qgemm_i8_fits(weight):
        raise ValueError(f"qgemm_i8_panels: W {weight.describe()} [{weight.out_features}, "
                         f"{weight.in_features}] is not read by qgemm_i8")
    nbytes = int(lib.plait_qgemm_i8_panels_bytes(weight.desc.data_ptr(), weight.in_features))
    check_rc(min(nbytes, 0), "qgemm_i8_panels", " (a build without AVX512-VNNI)")
    panels = torch.empty(nbytes, dtype=torch.uint8)
    if panels.data_ptr() % 64:
        raise RuntimeError("qgemm_i8_panels: torch's allocation is not 64-byte aligned")
    check_rc(lib.plait_qgemm_i8_pack(weight.desc.data_ptr(), weight.in_features,
                                   panels.data_ptr()), "qgemm_i8_panels")
    return panels


def i8_descriptor(
    weight: QuantWeight,
    panels: torch.Tensor,  # qgemm_i8_panels(weight)
    min_rows: int,  # qgemm computes products of this many rows or more from the panels
    compute_dtype: torch.dtype = torch.float32,  # below min_rows, as weight.descriptor's
) -> torch.Tensor:  # int64 [1 + 3 * parts + 2]
    """`weight.descriptor(compute_dtype)` flagged with resident panels (plait_cpu.h's
    PLAIT_QGEMM_I8): `qgemm` (and the decoder stack) then compute products of `min_rows`
    rows or more as `qgemm_i8`, from `panels`; `qgemm_i8` reads them for any row count.
    `weight` and `panels` must outlive it."""
    if min_rows < 1:
        raise ValueError(f"i8_descriptor: min_rows must be at least 1, not {min_rows}")
    base = weight.descriptor(compute_dtype)
    desc = torch.cat([base, torch.tensor([panels.data_ptr(), min_rows], dtype=torch.int64)])
    desc[0] |= I8_PANELS
    return desc


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


def dequantize_bf16(
    weight: QuantWeight,
    rows: torch.Tensor | None = None,  # [R] integer row ids in [0, N); None: all N rows
    out: torch.Tensor | None = None,  # [R, K] bfloat16 contiguous: written in place
) -> torch.Tensor:  # [R, K] bfloat16
    """`dequantize(weight, rows, torch.bfloat16, out)`."""
    return dequantize(weight, rows, torch.bfloat16, out)


def decode_attention(
    query: torch.Tensor,  # [T, H, D] float32; rows may be strided, heads and dims dense
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] float32 or bf16 contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] as k_cache
    block_tables: torch.Tensor,  # [num_seqs, W] int32 contiguous
    chunk_start: torch.Tensor,  # [C + 1] int64: chunk c is sequences start[c]..start[c+1]-1
    chunk_shared: torch.Tensor,  # [C] int32: leading tokens the chunk's sequences share
    q_rows: torch.Tensor,  # [S] int64 rows of `query`, one per sequence (chunk order)
    table_rows: torch.Tensor,  # [S] int64 rows of `block_tables`
    ctx_lens: torch.Tensor,  # [S] int32 tokens each sequence attends
    scale: float,
    out_rows: torch.Tensor | None = None,  # [S] int64 distinct: output row of each sequence
    compute_dtype: torch.dtype = torch.float32,  # or torch.bfloat16 (bf16 caches only)
    window: int = 0,  # > 0: each sequence attends only its last `window` tokens
    softcap: float = 0.0,  # > 0: scores s = scale q.k become softcap * tanh(s / softcap)
) -> torch.Tensor:  # [S, H, D] float32 in chunk order; [T, H, D] with out_rows
    """Softmax attention of each sequence's one query over its tokens [0, ctx_len), read
    from the paged cache in place. The sequences of a chunk share their first
    `chunk_shared` tokens (the same blocks: those of the chunk's first sequence), which are
    read once for all of them; at most `max_chunk_rows(H / H_kv)` sequences per chunk. A
    sequence may be one query position of a prefill (its context ends at that position).
    With `out_rows`, sequence i's result is row out_rows[i] of a [T, H, D] output (T the
    query's rows; rows no sequence names are left unwritten), as the caller orders them.
    bfloat16 caches (`KV_DTYPES`) are widened to float32 as they are read: the result is
    that of float32 caches holding the same values. With `compute_dtype` torch.bfloat16 over
    bfloat16 caches (`kv_dtype_code`), the tokens a chunk shares are attended with bf16 dot
    products (queries and softmax weights rounded to bf16, float32 sums; AVX512-BF16 builds,
    else float32 as without it); the rows' own tokens stay float32. `window` and `softcap`
    (0: off) as `reference.paged_attention_reference` takes them: a sequence's query sits at
    ctx_len - 1, so it attends tokens [ctx_len - window, ctx_len); the chunk still reads its
    shared tokens once, from its rows' lowest window start, each query masked to its own."""
    lib = loaded()
    if window < 0 or not softcap >= 0:
        raise ValueError(f"decode_attention: window must be >= 0 and softcap >= 0, not "
                         f"{window}, {softcap}")
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError("decode_attention: each query row must be [H, D] contiguous")
    for name, t, dtype in (("chunk_start", chunk_start, torch.int64),
                           ("chunk_shared", chunk_shared, torch.int32),
                           ("q_rows", q_rows, torch.int64),
                           ("table_rows", table_rows, torch.int64),
                           ("ctx_lens", ctx_lens, torch.int32),
                           ("block_tables", block_tables, torch.int32),
                           *((("out_rows", out_rows, torch.int64),) if out_rows is not None
                             else ())):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"decode_attention: {name} must be contiguous {dtype}")
    kv_dtype = kv_dtype_code(k_cache, v_cache, compute_dtype)
    if out_rows is not None and (out_rows.shape != q_rows.shape or (
            out_rows.numel() and not 0 <= int(out_rows.min()) <= int(out_rows.max())
            < query.shape[0])):
        raise ValueError("decode_attention: out_rows must be [S] rows of the query")
    rows = q_rows.shape[0] if out_rows is None else query.shape[0]
    out = torch.empty(rows, num_heads, head_dim, dtype=torch.float32)
    rc = lib.plait_decode_attention(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kv_dtype,
        block_size, num_kv_heads, num_heads, head_dim, block_tables.data_ptr(),
        block_tables.stride(0), chunk_shared.shape[0], chunk_start.data_ptr(),
        chunk_shared.data_ptr(), q_rows.data_ptr(), table_rows.data_ptr(),
        ctx_lens.data_ptr(), scale, window, softcap, out.data_ptr(),
        None if out_rows is None else out_rows.data_ptr())
    check_rc(rc, "decode_attention", f" (H={num_heads}, H_kv={num_kv_heads}, D={head_dim}, "
           f"block={block_size}, or a chunk of more than "
           f"{max_chunk_rows(num_heads // num_kv_heads)} rows)")
    return out


def rope_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> bool:
    """Whether `rope_write_kv` takes these tensors (float32 CPU, heads and dims dense, the
    caches contiguous, both float32 or both bfloat16) and the kernels are available."""
    return (available() and q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == "cpu" and kv_caches_fit(k_cache, v_cache)
            and q.shape[-1] % 2 == 0
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v)))


def rope_write_kv(
    q: torch.Tensor,  # [T, H, D] float32, rotated in place; rows may be strided
    k: torch.Tensor,  # [T, H_kv, D] float32
    v: torch.Tensor,  # [T, H_kv, D] float32
    cos_sin: torch.Tensor,  # [max_positions, R] float32: cos | sin halves, R even <= D
    positions: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] float32 or bf16 contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] as k_cache
    slot_mapping: torch.Tensor,  # [T] int64, -1 = not written
) -> torch.Tensor:  # q
    """`apply_rope` (neox style, over the first R dims of each head: partial rotary when
    R < D, the rest passed through) of q in place and of k, then `write_kv` of the rotated k
    and of v, in one pass over the step's tokens; the same bits as the plain-torch path
    (into a bfloat16 cache: the float32 values rounded to nearest even, as
    `.to(torch.bfloat16)`)."""
    if not rope_fits(q, k, v, k_cache, v_cache):
        raise ValueError("rope_write_kv: tensors do not fit (see rope_fits)")
    rot = cos_sin.shape[-1]
    if rot % 2 or not 0 < rot <= q.shape[2]:
        raise ValueError(f"rope_write_kv: a RoPE table of width {rot} for heads of "
                         f"{q.shape[2]}: the width must be even, > 0 and <= the head size")
    positions = positions.to(torch.int64).contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    cos_sin = cos_sin.contiguous()
    check_rc(loaded().plait_rope_write_kv(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        q.shape[0], q.shape[1], k.shape[1], q.shape[2], rot, cos_sin.data_ptr(),
        positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        KV_DTYPES[k_cache.dtype], slot_mapping.data_ptr()), "rope_write_kv")
    return q


def sample_inverse_cdf(
    logits: torch.Tensor,  # [R, V] float32 CPU, unit stride along V (masked = -inf)
    u: torch.Tensor,  # [R] or [R, 1] float32 in [0, 1)
) -> torch.Tensor:  # [R] int64
    """The token of each row whose cumulative weight first exceeds u times the row's total,
    weights exp(logit - max): `sampler._inverse_cdf` in one pass per row, the rows in
    parallel (C: plait_sample_inverse_cdf)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        raise ValueError("sample_inverse_cdf: logits must be [R, V] float32 on the CPU")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    u = u.reshape(rows).to(torch.float32).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    scratch = torch.empty(rows, vocab, dtype=torch.float32)
    check_rc(loaded().plait_sample_inverse_cdf(logits.data_ptr(), rows, vocab, logits.stride(0),
                                             u.data_ptr(), scratch.data_ptr(), out.data_ptr()),
           "sample_inverse_cdf")
    return out


def rows_fit(*tensors: torch.Tensor,
             dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the row-wise kernels (`add_rms_norm`, `silu_mul`) take these [T, D] tensors:
    one of `dtypes` on the CPU, unit stride along D, and the kernels available."""
    return available() and all(t.dtype in dtypes and t.device.type == "cpu"
                               and t.dim() == 2 and t.stride(1) == 1 for t in tensors)


def add_rms_norm(
    x: torch.Tensor,  # [T, D] float32, unit stride along D
    add: torch.Tensor | None,  # [T, D] float32, unit stride along D; None: nothing added
    weight: torch.Tensor,  # [D] float32
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + add, or x itself), normalized: [T, D] each
    """RMS normalization of x + add in one pass per row (the residual add fused): returns
    the sum (the residual stream) and sum * weight / sqrt(mean(sum^2) + eps)."""
    if not rows_fit(x, *(() if add is None else (add,))) or weight.dtype != torch.float32:
        raise ValueError("add_rms_norm: tensors do not fit (see rows_fit)")
    rows, dim = x.shape
    weight = weight.contiguous()
    total = x if add is None else torch.empty(rows, dim, dtype=torch.float32)
    out = torch.empty(rows, dim, dtype=torch.float32)
    check_rc(loaded().plait_add_rms_norm(
        x.data_ptr(), x.stride(0), None if add is None else add.data_ptr(),
        0 if add is None else add.stride(0), weight.data_ptr(), rows, dim, eps,
        None if add is None else total.data_ptr(), out.data_ptr()), "add_rms_norm")
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """silu(gate) * up of a fused gate|up projection's output, in one pass. float32 in,
    float32 out; bfloat16 in, bfloat16 out (float32 arithmetic on the widened values, the
    result rounded to nearest even: `silu_mul(gate_up.float()).bfloat16()`, bit for bit)."""
    bf16 = gate_up.dtype == torch.bfloat16
    if not rows_fit(gate_up, dtypes=(torch.float32, torch.bfloat16)) or gate_up.shape[1] % 2:
        raise ValueError("silu_mul: gate_up must be [T, 2 I] float32 or bfloat16 with unit "
                         "stride")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    kernel = loaded().plait_silu_mul_bf16 if bf16 else loaded().plait_silu_mul
    check_rc(kernel(gate_up.data_ptr(), gate_up.stride(0), rows, inter, out.data_ptr()),
           "silu_mul")
    return out


def max_chunk_rows(group: int) -> int:
    """The most sequences one chunk of `decode_attention` may hold, with `group` query heads
    per KV head (0 when even one sequence's heads do not fit)."""
    return MAX_QUERIES // max(1, group)


@functools.cache
def supports_attention(num_heads: int, num_kv_heads: int, head_dim: int,
                       block_size: int) -> bool:
    """Whether `decode_attention` takes these shapes (the C kernel's limits)."""
    if not available():
        return False
    return (num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_QUERIES
            and head_dim % lanes() == 0 and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK)


__all__ = ["ATTN_BF16_DOT", "F32_PANELS", "I8_PANELS", "I8_TYPES", "KV_DTYPES", "MAX_QUERIES",
           "QUANT_TYPES", "STACK_POINTERS", "add_rms_norm",
           "available", "check_rc", "decode_attention", "dequantize", "dequantize_bf16",
           "gemm", "has_qgemm_i8", "i8_descriptor", "kv_caches_fit", "kv_dtype_code", "lanes",
           "max_chunk_rows", "pack_weight", "panels_desc", "qgemm", "qgemm_i8", "qgemm_i8_fits",
           "qgemm_i8_panels", "rope_fits", "rope_write_kv", "rows_fit", "sample_inverse_cdf",
           "silu_mul", "supports_attention"]
