"""Plain-torch reference implementations of the paged-attention kernels.

These are the CPU backend and the ground truth the Triton kernels are tested against.

Cache layout, per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A sequence's logical token t lives in block `block_tables[s, t // block_size]` at offset
`t % block_size`. Queries of sequence s are the last `num_q = cu_seqlens_q[s+1] -
cu_seqlens_q[s]` tokens of its `context_lens[s]` tokens; query j sits at absolute position
`context_lens[s] - num_q + j` and attends causally to keys 0..that position.

    context: |<--------- cached prefix --------->|<--- new (queries) --->|
    tokens:   0 1 2 ...                           ctx-num_q         ctx-1
"""

from __future__ import annotations

import torch


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not written
) -> None:
    """Store each token's K/V at its slot. Tokens with slot -1 are skipped."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k[slots] = key[valid].to(k_cache.dtype)
    flat_v[slots] = value[valid].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, num_blocks_per_seq]
    length: int,
) -> torch.Tensor:  # [num_seqs, length, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks_needed = (length + block_size - 1) // block_size
    ids = block_table[:, :num_blocks_needed].long().clamp_min(0)
    gathered = cache[ids]  # [num_seqs, nb, block_size, H_kv, D]
    return gathered.flatten(1, 2)[:, :length]


def _attend(
    query: torch.Tensor,  # [S, Q, H, D]
    key: torch.Tensor,  # [S, L, H_kv, D]
    value: torch.Tensor,  # [S, L, H_kv, D]
    mask: torch.Tensor,  # [S, Q, L] bool, True = attend
    scale: float,
) -> torch.Tensor:  # [S, Q, H, D]
    """Grouped-query attention without repeating K/V: the `group` query heads that share a
    KV head are stacked along the query axis, [S, H_kv, group * Q, D]."""
    num_seqs, num_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    # query heads h = kv * group + g  ->  rows ordered (g, q) inside each KV head
    q = query.view(num_seqs, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * num_q, head_dim)
    rows_mask = mask.repeat(1, group, 1).unsqueeze(1)  # [S, 1, group * Q, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), key.transpose(1, 2).float(), value.transpose(1, 2).float(),
        attn_mask=rows_mask, scale=scale,
    )  # [S, H_kv, group * Q, D]
    out = out.view(num_seqs, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, num_q, num_heads, head_dim).to(query.dtype)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] start of each sequence's queries in `query`
    context_lens: torch.Tensor,  # [num_seqs] tokens in the KV cache incl. the new ones
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padding = -1
    scale: float,
    max_query_len: int,
    max_context_len: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's queries over its paged K/V.

    Decode sequences (one query) are attended in one batched call; sequences with several
    queries (prefill chunks) one at a time, so no query is padded to the longest prefill.
    `max_query_len` / `max_context_len` are upper bounds the Triton launcher needs; the
    reference only uses them for validation.
    """
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    num_q = [starts[i + 1] - starts[i] for i in range(len(ctx))]
    if max(num_q, default=0) > max_query_len or max(ctx, default=0) > max_context_len:
        raise ValueError("max_query_len / max_context_len smaller than the batch needs")
    decode_idx = [i for i, n in enumerate(num_q) if n == 1]
    if decode_idx:
        idx = torch.tensor(decode_idx, device=query.device)
        lens = context_lens.to(query.device)[idx].long()  # [S_d]
        length = int(max(ctx[i] for i in decode_idx))
        key = _gather_context(k_cache, block_tables[idx], length)
        value = _gather_context(v_cache, block_tables[idx], length)
        mask = torch.arange(length, device=query.device)[None, :] < lens[:, None]
        token_idx = torch.tensor([starts[i] for i in decode_idx], device=query.device)
        q = query[token_idx].unsqueeze(1)  # [S_d, 1, H, D]
        out[token_idx] = _attend(q, key, value, mask.unsqueeze(1), scale).squeeze(1)
    for i, n in enumerate(num_q):
        if n <= 1:
            continue
        key = _gather_context(k_cache, block_tables[i : i + 1], ctx[i])
        value = _gather_context(v_cache, block_tables[i : i + 1], ctx[i])
        q_pos = torch.arange(ctx[i] - n, ctx[i], device=query.device)
        mask = torch.arange(ctx[i], device=query.device)[None, :] <= q_pos[:, None]
        q = query[starts[i] : starts[i + 1]].unsqueeze(0)
        out[starts[i] : starts[i + 1]] = _attend(q, key, value, mask.unsqueeze(0), scale)[0]
    return out
