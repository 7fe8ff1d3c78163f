"""Plain-torch reference implementations of the paged-attention kernels.

The ground truth every other backend is tested against (the native CPU kernels, the CPU
attention backend in `cpu/attention.py`, the Triton kernels in `cuda/`), and the plain
attention of the torch ops table with cascade attention off (`ops.py`).

Cache layout, per layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A sequence's logical token t lives in block `block_tables[s, t // block_size]` at offset
`t % block_size`. Queries of sequence s are the last `num_q = cu_seqlens_q[s+1] -
cu_seqlens_q[s]` tokens of its `context_lens[s]` tokens; query j sits at absolute position
`context_lens[s] - num_q + j` and attends causally to keys 0..that position.

    context: |<--------- cached prefix --------->|<--- new (queries) --->|
    tokens:   0 1 2 ...                           ctx-num_q         ctx-1

Two variants every attention path takes (the same keywords everywhere, 0 = off):

* `window` > 0, a sliding window: the query at position p attends only keys k with
  0 <= p - k < window (itself and window - 1 earlier: Hugging Face's / llama.cpp's
  `sliding_window`);
* `softcap` > 0, a logit softcap after the scale: s = softcap * tanh(scale q.k / softcap)
  before the softmax (Gemma 2).

        window 3, query at p = 5:   keys  0 1 2 3 4 5 6
                                          . . . x x x .     (x = attended)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not written
    padded: bool | None = None,  # whether a slot is -1; None: look (a host sync)
) -> None:
    """Store each token's K/V at its slot. Tokens with slot -1 are skipped.

    When every slot is valid (the runner's case: it never pads, and says so with
    `padded=False`) this is one `index_copy_` per cache: no boolean-mask gathers of K/V, no
    temporaries, and no multithreaded `index_put_`, whose thread start-up alone costs
    milliseconds on a busy 2-core CPU.
    """
    num_blocks, block_size = k_cache.shape[:2]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    slots = slot_mapping.long()
    if padded is None:
        padded = bool(slot_mapping.numel()) and bool(slot_mapping.min() < 0)
    if padded:
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


@dataclass(slots=True)
class _SeqGroup:
    """Sequences attended in one SDPA call: their query rows, gathered blocks and mask."""

    token_idx: torch.Tensor | slice  # rows of `query` (a slice for one prefill)
    block_ids: torch.Tensor  # [S * nb] cache blocks to gather, in order
    num_seqs: int
    num_q: int  # queries per sequence (1 for decodes)
    length: int  # keys attended (padded to the longest context in the group)
    mask: torch.Tensor  # [S, 1, group * num_q, length] bool, True = attend (causal only)
    # absolute positions, for a window (`window_mask`): of each mask row's query and of
    # each gathered key (broadcastable against `mask`)
    q_pos: torch.Tensor  # [S, 1, group * num_q or 1, 1] int64
    k_pos: torch.Tensor  # [S or 1, 1, 1, length] int64


def window_mask(g: _SeqGroup, window: int) -> torch.Tensor:  # [S, 1, group * num_q, L]
    """`g.mask`, and with `window` > 0 only the keys within the window of each query
    (q_pos - k_pos < window; the causal mask already has q_pos >= k_pos)."""
    if window <= 0:
        return g.mask
    return g.mask & (g.q_pos - g.k_pos < window)


def check_variants(window: int, softcap: float) -> None:
    """ValueError unless `window` and `softcap` are >= 0 (0: the variant is off)."""
    if window < 0 or not softcap >= 0:
        raise ValueError(f"window must be >= 0 and softcap >= 0, not {window}, {softcap}")


def _rows(token_rows: list[int], device: torch.device) -> torch.Tensor | slice:
    """Rows of `query` as a slice when they are consecutive (basic indexing: no gather)."""
    if token_rows == list(range(token_rows[0], token_rows[0] + len(token_rows))):
        return slice(token_rows[0], token_rows[0] + len(token_rows))
    return torch.tensor(token_rows, device=device)


def split_batch(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                max_context_len: int) -> tuple[list[int], list[int], list[int]]:
    """Host copies of the batch's layout: (query starts [S + 1], context lens [S], queries
    per sequence [S]). Raises if the batch exceeds the launcher's stated bounds."""
    starts = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    num_q = [starts[i + 1] - starts[i] for i in range(len(ctx))]
    if max(num_q, default=0) > max_query_len or max(ctx, default=0) > max_context_len:
        raise ValueError("max_query_len / max_context_len smaller than the batch needs")
    return starts, ctx, num_q


def decode_group(
    decode_idx: list[int], starts: list[int], ctx: list[int], block_tables: torch.Tensor,
    block_size: int, group: int, first_blocks: list[int] | None = None,
) -> _SeqGroup:
    """All decode sequences in one padded group. Sequence `decode_idx[i]` attends its keys
    from block `first_blocks[i]` on (0 when None), i.e. tokens [first * block_size, ctx).

        table row:  [b0 b1 b2 | b3 b4 -1]   first_blocks = 3  ->  gathers [b3 b4 pad]
    """
    device = block_tables.device
    first = first_blocks or [0] * len(decode_idx)
    lens = [ctx[i] - f * block_size for i, f in zip(decode_idx, first, strict=True)]
    length = max(lens)
    nb = -(-length // block_size)
    idx = torch.tensor(decode_idx, device=device)
    cols = torch.tensor(first, device=device)[:, None] + torch.arange(nb, device=device)
    cols = cols.clamp_max(block_tables.shape[1] - 1)  # past the row's end: padding, masked
    block_ids = block_tables[idx].long().gather(1, cols).clamp_min(0).flatten()  # [S * nb]
    lens_t = torch.tensor(lens, device=device)
    mask = torch.arange(length, device=device)[None, :] < lens_t[:, None]  # [S_d, L]
    q_pos = torch.tensor([ctx[i] - 1 for i in decode_idx], device=device)  # [S_d]
    k_pos = cols[:, :1] * block_size + torch.arange(length, device=device)  # [S_d, L]
    return _SeqGroup(_rows([starts[i] for i in decode_idx], device), block_ids,
                     len(decode_idx), 1, length, mask[:, None, None, :].expand(-1, 1, group, -1),
                     q_pos.view(-1, 1, 1, 1), k_pos[:, None, None, :])


def prefill_groups(
    num_q: list[int], starts: list[int], ctx: list[int], block_tables: torch.Tensor,
    block_size: int, group: int,
) -> list[_SeqGroup]:
    """One group per sequence with several queries (a prefill chunk), causally masked."""
    device = block_tables.device
    groups = []
    for i, n in enumerate(num_q):
        if n <= 1:
            continue
        nb = -(-ctx[i] // block_size)
        q_pos = torch.arange(ctx[i] - n, ctx[i], device=device)  # [n]
        k_pos = torch.arange(ctx[i], device=device)  # [L]
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, L]
        groups.append(_SeqGroup(
            slice(starts[i], starts[i + 1]), block_tables[i, :nb].long().clamp_min(0), 1, n,
            ctx[i], mask.repeat(group, 1)[None, None], q_pos.repeat(group)[None, None, :, None],
            k_pos[None, None, None, :]))
    return groups


def plan_reference(
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
    block_size: int, group: int, max_query_len: int, max_context_len: int,
) -> list[_SeqGroup]:
    """The batch as `paged_attention_reference` attends it: one group of all decodes plus
    one group per prefill chunk (a host sync: compute it once per step)."""
    starts, ctx, num_q = split_batch(cu_seqlens_q, context_lens, max_query_len,
                                     max_context_len)
    decode_idx = [i for i, n in enumerate(num_q) if n == 1]
    groups = []
    if decode_idx:
        groups.append(decode_group(decode_idx, starts, ctx, block_tables, block_size, group))
    return groups + prefill_groups(num_q, starts, ctx, block_tables, block_size, group)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int,
                  length: int) -> torch.Tensor:  # [num_seqs, length, H_kv, D]
    """The first `length` cached tokens of each of `num_seqs` sequences whose blocks are
    `block_ids` (their tables concatenated, the same number of blocks each).
    cache: [num_blocks, block_size, H_kv, D]."""
    shape = (num_seqs, -1, *cache.shape[2:])
    return cache.index_select(0, block_ids).view(shape)[:, :length]


def capped_scores(dots: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """The scores of q.k products `dots`: scale * dots, then with `softcap` > 0
    softcap * tanh(scale * dots / softcap) (any shape, float32)."""
    scores = dots * scale
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def _attend(
    query: torch.Tensor,  # [S, Q, H, D]
    key: torch.Tensor,  # [S, L, H_kv, D]
    value: torch.Tensor,  # [S, L, H_kv, D]
    mask: torch.Tensor,  # [S, 1, group * Q, L] bool, True = attend
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:  # [S, Q, H, D]
    """Grouped-query attention without repeating K/V: the `group` query heads that share a
    KV head are stacked along the query axis, [S, H_kv, group * Q, D]. With `softcap` > 0
    the scaled scores are capped (`capped_scores`) before the softmax, in float32 (SDPA
    takes no softcap). Every query must attend at least one key."""
    num_seqs, num_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    # query heads h = kv * group + g  ->  rows ordered (g, q) inside each KV head
    q = query.view(num_seqs, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * num_q, head_dim)
    k, v = key.transpose(1, 2).float(), value.transpose(1, 2).float()  # [S, H_kv, L, D]
    if softcap > 0:
        scores = capped_scores(q.float() @ k.transpose(-1, -2), scale, softcap)
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k, v, attn_mask=mask, scale=scale)  # [S, H_kv, group * Q, D]
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
    plan: list[_SeqGroup] | None = None,  # `plan_reference` of this batch; None: made here
    window: int = 0,  # > 0: sliding window (module docstring); 0: full causal
    softcap: float = 0.0,  # > 0: logit softcap after the scale; 0: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's queries over its paged K/V, optionally within a
    sliding `window` and with softcapped logits (the plan does not depend on either: one
    plan serves every layer of a step).

    Decode sequences (one query) are attended in one batched call; sequences with several
    queries (prefill chunks) one at a time, so no query is padded to the longest prefill.
    `max_query_len` / `max_context_len` are upper bounds the Triton launcher needs; the
    reference only uses them for validation.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    check_variants(window, softcap)
    out = torch.empty_like(query)
    if plan is None:
        plan = plan_reference(cu_seqlens_q, context_lens, block_tables, block_size, group,
                              max_query_len, max_context_len)
    for g in plan:
        key = gather_blocks(k_cache, g.block_ids, g.num_seqs, g.length)
        value = gather_blocks(v_cache, g.block_ids, g.num_seqs, g.length)
        q = query[g.token_idx].view(g.num_seqs, g.num_q, -1, head_dim)
        attended = _attend(q, key, value, window_mask(g, window), scale, softcap)
        out[g.token_idx] = attended.view(-1, *query.shape[1:])
    return out
