"""The native paged attention (attention.c, attention_bf16.h): `decode_attention`, one
query per sequence over its paged K/V, read in place; rows that share a prompt's blocks
read them once (the CPU attention backend also feeds it prefill positions, in tiles). Also
the KV caches' element codes and the kernel's shape limits.

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
    available,
    check_rc,
    loaded,
)
from plait.kernels.cpu.native_gemm import lanes

# The KV-cache element types the kernels write and read, as plait_cpu.h's PLAIT_KV_* codes:
# bfloat16 is rounded to nearest even when written, widened to float32 (exact) when read.
KV_DTYPES: dict[torch.dtype, int] = {torch.float32: ABI.constants["PLAIT_KV_F32"],
                                     torch.bfloat16: ABI.constants["PLAIT_KV_BF16"]}
# OR-ed into a bfloat16 cache's code for bfloat16 compute: the attention's tokens with bf16
# dot products (plait_cpu.h's PLAIT_ATTN_BF16_DOT).
ATTN_BF16_DOT = ABI.constants["PLAIT_ATTN_BF16_DOT"]
# OR-ed into a bfloat16 dot code for prompt rows: AMX-BF16 tiles (plait_cpu.h's
# PLAIT_ATTN_AMX; `prompt_attention_amx` says where it runs).
ATTN_AMX = ABI.constants["PLAIT_ATTN_AMX"]


@functools.cache
def prompt_attention_amx() -> bool:
    """Whether `decode_attention(..., prompt_rows=True)` runs in this process: a build with
    AMX-BF16 whose repacked products take prompt rows too (`repack.prompt_bf16()`; not with
    PLAIT_REPACK_AMX=0). Asked once: the answer holds for the process."""
    return available() and bool(loaded().plait_attention_amx())


def takes_prompt_rows(k_cache: torch.Tensor, compute_dtype: torch.dtype, head_dim: int,
                      window: int = 0, softcap: float = 0.0) -> bool:
    """Whether prompt rows of a layer with these caches and variants go through the AMX
    tiles (`decode_attention`'s `prompt_rows`): bfloat16 caches and compute, head_dim a
    multiple of 32, no window, no softcap, and `prompt_attention_amx()`. Depends on the
    layer only, never on the step, so a prompt row's bits do not depend on its step."""
    return (k_cache.dtype == compute_dtype == torch.bfloat16 and head_dim % 32 == 0
            and window == 0 and softcap == 0 and prompt_attention_amx())


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
    prompt_rows: bool = False,  # the rows are prompt rows: AMX tiles (`takes_prompt_rows`)
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
    bfloat16 caches (`kv_dtype_code`), every token is attended with bf16 dot products
    (queries and softmax weights rounded to bf16, float32 sums; AVX512-BF16 builds, else
    float32 as without it). A sequence's result is the same bits whatever its chunk, its
    chunk's shared count and the call's other sequences (row invariance: a prefill's
    positions, a draft's verification rows and one-row decode steps agree). `window` and
    `softcap` (0: off) as `reference.paged_attention_reference` takes them: a sequence's
    query sits at ctx_len - 1, so it attends tokens [ctx_len - window, ctx_len); the chunk
    still reads its shared tokens once, from its rows' lowest window start, each query
    masked to its own. With `prompt_rows` (where `takes_prompt_rows`; the C kernel refuses
    it elsewhere) every query walks its own tokens in AMX-BF16 tiles and chunk_shared plays
    no part (attention_amx.h): other bits than without it, and still a function of the
    query and its tokens alone."""
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
    kv_dtype = kv_dtype_code(k_cache, v_cache, compute_dtype) | (ATTN_AMX if prompt_rows else 0)
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


__all__ = ["ATTN_BF16_DOT", "KV_DTYPES", "decode_attention", "kv_caches_fit", "kv_dtype_code",
           "max_chunk_rows", "supports_attention"]
