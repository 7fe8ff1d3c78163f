"""Triton paged attention for a flattened variable-length batch (prefills and decodes).

Same contract as `reference.paged_attention_reference`. One program owns a tile of
BLOCK_M (query token, query head) rows that share one KV head (GQA packing), so each K/V
tile it reads from the cache serves every query head of the group:

    rows of a tile, GROUP = 3:   row r -> query q = r // GROUP, head kv_head * GROUP + r % GROUP
        r:  0  1  2  3  4  5  6 ...
        q:  0  0  0  1  1  1  2 ...
        h:  0  1  2  0  1  2  0 ...

    grid = (num_m_tiles * num_splits, num_kv_heads, num_seqs)
    num_m_tiles = cdiv(max_query_len * GROUP, BLOCK_M); tiles past a sequence's queries exit.

Each program runs an online softmax (base 2, fp32 accumulators) over BLOCK_N-key tiles of
its sequence, reading every key's block id from `block_tables`, so any block_size works,
and stops at the tile's last query position (causal). With num_splits > 1 (flash
decoding, chosen for decode-only batches too small to fill the GPU) the key tiles are
split into contiguous chunks whose normalised partial outputs and log-sum-exps are merged
by `_combine_splits_kernel`:

    keys:  |-- split 0 --|-- split 1 --|-- split 2 --|     out = sum_i w_i * out_i,
                                                            w_i = 2^(lse_i - max lse) / sum

The variants (`reference.py`), compile-time switches so the default kernel is unchanged:
a sliding `window` masks keys k with q_pos - k >= window and starts the key loop at the
tile holding the tile's first query's first key (the tiles before it are not read; with
splits, the remaining tiles are split); a `softcap` caps the base-2 logits as
softcap' * tanh(s / softcap'), softcap' = softcap * log2(e) (the same as capping the
natural logits, then converting).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_MAX_GRID_Z = 65535  # CUDA limit on the third grid dimension (here: num_seqs)
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism
_MAX_SPLITS = 32


@triton.jit
def _tanh(x):
    """tanh to a few float32 ulps: the odd Taylor polynomial to x^13 below |x| = 0.5 (no
    cancellation near 0), else (1 - e) / (1 + e) with e = e^(-2|x|) <= 0.37."""
    ax = tl.abs(x)
    x2 = ax * ax
    p = 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    e = tl.exp(-2.0 * ax)
    t = tl.where(ax < 0.5, ax + ax * x2 * p, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    qk_scale,  # softmax scale * log2(e): the loop uses exp2
    window,  # HAS_WINDOW: keys k with q_pos - k < window
    softcap_log2,  # HAS_SOFTCAP: softcap * log2(e), the cap of the base-2 logits
    num_tokens, num_heads, num_splits,
    stride_q_t, stride_q_h, stride_q_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_k_b, stride_k_s, stride_k_h, stride_k_d,
    stride_v_b, stride_v_s, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_b,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # (query, head) rows per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    SPLIT_OUTPUT: tl.constexpr,  # True: write partials for _combine_splits_kernel
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # window > 0
    HAS_SOFTCAP: tl.constexpr,  # softcap > 0
):
    m_tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    seq_idx = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    num_q = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    row_lo = m_tile * BLOCK_M
    if row_lo >= num_q * GROUP:
        return
    context_len = tl.load(context_lens_ptr + seq_idx)
    rows = row_lo + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = rows // GROUP  # [BLOCK_M] query index within the sequence
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_valid = q_idx < num_q
    q_pos = context_len - num_q + q_idx  # [BLOCK_M] absolute position of each query
    # keys after the tile's last query are masked for every row: the loop stops there
    last_q = tl.minimum(num_q - 1, (row_lo + BLOCK_M - 1) // GROUP)
    kv_len = context_len - num_q + last_q + 1
    num_kv_tiles = tl.cdiv(kv_len, BLOCK_N)
    first_tile = 0
    if HAS_WINDOW:  # keys before the tile's first query's window are masked for every row
        first_key = tl.maximum(context_len - num_q + row_lo // GROUP - window + 1, 0)
        first_tile = first_key // BLOCK_N
    tiles_per_split = tl.cdiv(num_kv_tiles - first_tile, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_kv_tiles)

    tokens = (q_start + q_idx).to(tl.int64)  # [BLOCK_M]
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    q_offs = tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d
    q = tl.load(query_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt_s
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical token index
        kv_valid = kv_pos < kv_len
        block_ids = tl.load(
            block_table + (kv_pos // BLOCK_SIZE) * stride_bt_b, mask=kv_valid, other=0
        ).to(tl.int64)  # [BLOCK_N]; int64 so block_id * stride cannot overflow
        in_block = kv_pos % BLOCK_SIZE
        k_offs = block_ids * stride_k_b + in_block * stride_k_s + kv_head * stride_k_h
        k = tl.load(
            k_cache_ptr + k_offs[None, :] + dims[:, None] * stride_k_d,
            mask=kv_valid[None, :], other=0.0,
        )  # [HEAD_DIM, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap_log2 * _tanh(s / softcap_log2)
        attend = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if HAS_WINDOW:
            attend = attend & (q_pos[:, None] - kv_pos[None, :] < window)
        s = tl.where(attend, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet (only possible in a later split) keeps m = -inf: avoid NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_safe)  # rescales what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offs = block_ids * stride_v_b + in_block * stride_v_s + kv_head * stride_v_h
        v = tl.load(
            v_cache_ptr + v_offs[:, None] + dims[None, :] * stride_v_d,
            mask=kv_valid[:, None], other=0.0,
        )  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT_OUTPUT:
        # partials: part_out [num_splits, num_tokens, num_heads, HEAD_DIM], part_lse without D
        has_keys = l_i > 0
        l_safe = tl.where(has_keys, l_i, 1.0)
        lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
        part_rows = (split * num_tokens + tokens) * num_heads + heads  # [BLOCK_M] int64
        tl.store(part_lse_ptr + part_rows, lse, mask=row_valid)
        tl.store(
            part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :],
            acc / l_safe[:, None], mask=row_valid[:, None],
        )
    else:
        o_offs = tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h
        tl.store(
            out_ptr + o_offs + dims[None, :] * stride_o_d,
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None],
        )


@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_tokens, num_heads, num_splits,
    stride_o_t, stride_o_h, stride_o_d,
    HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr,  # num_splits rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2).to(tl.int64)  # [SPLITS_POW2]
    split_valid = splits < num_splits
    part_rows = (splits * num_tokens + token) * num_heads + head  # [SPLITS_POW2]
    lse = tl.load(part_lse_ptr + part_rows, mask=split_valid, other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))  # [SPLITS_POW2]; empty splits weigh 0
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(
        part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None], other=0.0,
    )  # [SPLITS_POW2, HEAD_DIM]
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + dims * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
    )


def _check_inputs(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected query [T, H, D] and equal caches [B, S, H_kv, D], got "
            f"{tuple(query.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"query heads/dim {num_heads}/{head_dim} do not fit cache {num_kv_heads}/"
            f"{k_cache.shape[3]}: num_heads must be a multiple of num_kv_heads"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if not query.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: {query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {query.dtype}")
    num_seqs = context_lens.shape[0]
    if (
        context_lens.dim() != 1
        or cu_seqlens_q.shape != (num_seqs + 1,)
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
    ):
        raise ValueError(
            f"need cu_seqlens_q [S+1], context_lens [S], block_tables [S, N]; got "
            f"{tuple(cu_seqlens_q.shape)}, {tuple(context_lens.shape)}, "
            f"{tuple(block_tables.shape)}"
        )
    if num_seqs > _MAX_GRID_Z:
        raise ValueError(f"at most {_MAX_GRID_Z} sequences per call, got {num_seqs}")
    tensors = (query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device, got {[t.device for t in tensors]}")


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_num_splits(
    query: torch.Tensor, num_programs: int, max_query_len: int, max_context_len: int
) -> int:
    """Split the keys only for decode-only CUDA batches too small to fill the GPU twice."""
    if not query.is_cuda or max_query_len != 1:
        return 1
    target = 2 * _num_sms(query.device)
    if num_programs >= target:
        return 1
    splits = min(
        triton.cdiv(target, num_programs),
        triton.cdiv(max_context_len, _MIN_KEYS_PER_SPLIT),
        _MAX_SPLITS,
    )
    return 1 << (max(splits, 1).bit_length() - 1)  # power of two: few compiled variants


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] start of each sequence's queries in `query`
    context_lens: torch.Tensor,  # [num_seqs] tokens in the KV cache incl. the new ones
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padding = -1
    scale: float,
    max_query_len: int,
    max_context_len: int,
    *,
    num_splits: int | None = None,
    window: int = 0,  # > 0: sliding window (reference.py); 0: full causal
    softcap: float = 0.0,  # > 0: logit softcap after the scale; 0: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal paged attention; see `reference.paged_attention_reference` for the semantics
    (`window` and `softcap` included; 0 compiles the kernel without them).

    No host sync: `max_query_len` must be >= every sequence's query count (rows beyond it
    are left unwritten) and `max_context_len` is only a hint for the split heuristic.
    Tokens not covered by `cu_seqlens_q` are left unwritten. `num_splits` overrides the
    flash-decoding split count (tests); by default it is 1 except for small decode batches.
    """
    _check_inputs(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    if window < 0 or not softcap >= 0:
        raise ValueError(f"window must be >= 0 and softcap >= 0, not {window}, {softcap}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len * group)))
    block_n = min(64, max(16, triton.next_power_of_2(max_context_len)))
    num_m_tiles = triton.cdiv(max_query_len * group, block_m)
    if num_splits is None:
        keys = min(max_context_len, window) if window else max_context_len  # per query
        num_splits = _default_num_splits(
            query, num_m_tiles * num_kv_heads * num_seqs, max_query_len, keys
        )
    if num_splits > 1:
        part_out = torch.empty((num_splits, num_tokens, num_heads, head_dim),
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_splits, num_tokens, num_heads),
                               dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # not touched by the kernel when SPLIT_OUTPUT is False
    _paged_attention_kernel[(num_m_tiles * num_splits, num_kv_heads, num_seqs)](
        query_ptr=query, k_cache_ptr=k_cache, v_cache_ptr=v_cache, out_ptr=out,
        part_out_ptr=part_out, part_lse_ptr=part_lse,
        cu_seqlens_q_ptr=cu_seqlens_q, context_lens_ptr=context_lens,
        block_tables_ptr=block_tables,
        qk_scale=scale * 1.4426950408889634,  # log2(e)
        window=window, softcap_log2=softcap * 1.4426950408889634,
        num_tokens=num_tokens, num_heads=num_heads, num_splits=num_splits,
        stride_q_t=query.stride(0), stride_q_h=query.stride(1), stride_q_d=query.stride(2),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
        stride_k_b=k_cache.stride(0), stride_k_s=k_cache.stride(1),
        stride_k_h=k_cache.stride(2), stride_k_d=k_cache.stride(3),
        stride_v_b=v_cache.stride(0), stride_v_s=v_cache.stride(1),
        stride_v_h=v_cache.stride(2), stride_v_d=v_cache.stride(3),
        stride_bt_s=block_tables.stride(0), stride_bt_b=block_tables.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_OUTPUT=num_splits > 1,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_out_ptr=part_out, part_lse_ptr=part_lse, out_ptr=out,
            num_tokens=num_tokens, num_heads=num_heads, num_splits=num_splits,
            stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
            HEAD_DIM=head_dim, SPLITS_POW2=triton.next_power_of_2(num_splits),
        )
    return out
