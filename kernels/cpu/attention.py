"""The CPU attention backend: shared-prefix (cascade) paged attention.

The n choices of one prompt decode with block tables that start with the same block ids
(the prompt's full blocks). Plain paged attention gathers and attends that prefix once per
row; here it is gathered once per group and attended by the stacked queries of all the
group's rows, each row then attends only its own suffix, and the two partial softmaxes are
merged with their log-sum-exps (Hydragen / FlashInfer cascade):

    row a:  [p0 p1 p2 p3 | a4 a5]      prefix: p0..p3, once, queries of a, b, c stacked
    row b:  [p0 p1 p2 p3 | b4]         suffix: a4 a5 / b4 / c4 c5, one padded batched call
    row c:  [p0 p1 p2 p3 | c4 c5]      out = (e^(lse_p) o_p + e^(lse_s) o_s) / (e^lse_p + e^lse_s)

Groups come from the block tables alone: decode rows are grouped by their first block id,
and a group's prefix is the longest leading run of block ids all its rows share, capped so
every row keeps at least one suffix token. Prefill chunks are attended exactly as in
`paged_attention_reference`. The result equals `paged_attention_reference` up to float
rounding (the merge reorders the softmax sums).

With the native kernels (`native.py`, the CPU ops table in `ops.py`), every row of the step
is attended by the C kernel straight from the cache blocks, in one call (`plan_native`,
`native_attention`), with the same grouping: the rows
of a shared prefix, in chunks of up to 48 query heads, read it once, and one online softmax
carries on over each row's own tokens, so there is no gather, no padded SDPA call and no
merge (with unique contexts, 16 streams of ~550 tokens, the gather alone copied ~15 MB of
K/V per layer and step). A prefill chunk goes the same way, as tiles of consecutive query
positions: each tile's rows share the tokens before its first position, and attend their
own few causally (`prefill_tiles`).

Sliding windows and logit softcaps (`reference.py`'s `window`, `softcap`) are attention-time
arguments: the plans do not depend on them, so one plan serves a step's global and windowed
layers alike. With a window, the rows of a shared prefix still attend it once, each row
masking the prefix keys before its own window (in torch: a per-row bias on the prefix
call; rows whose window lies wholly after the prefix get an empty prefix, weight 0 in the
merge; natively: the kernel starts the shared tokens at the lowest row's window and masks
per query where the rows' windows differ, `attention.c`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from plait.kernels.cpu import native
from plait.kernels.reference import (
    _attend,
    _rows,
    _SeqGroup,
    capped_scores,
    check_variants,
    decode_group,
    gather_blocks,
    prefill_groups,
    split_batch,
    window_mask,
)

# The fused CPU attention that also returns the log-sum-exp (a private aten op; the
# fallback computes the same in plain torch, as on CUDA).
_HAS_FLASH_CPU = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")

# A prefix shorter than this many blocks is not worth its own attention call and merge.
MIN_PREFIX_BLOCKS = 4


@dataclass(slots=True)
class _Prefix:
    """Decode rows (positions in the decode group) sharing their first `block_ids`."""

    rows: torch.Tensor | slice  # [G] rows of the decode group (a slice when consecutive)
    num_rows: int
    block_ids: torch.Tensor  # [P_blocks] int64 cache blocks of the shared prefix
    max_pos: int  # the largest query position of its rows (a window cuts in iff >= window)
    # the first block when the prefix's blocks are consecutive ids (as a prompt allocated
    # at once usually is): its K/V are then a view of the cache, not a gather
    first_block: int | None = None


@dataclass(slots=True)
class NativeRows:
    """The step's rows as `native.decode_attention` takes them, host tensors: the decode rows
    in chunks of rows sharing a prefix (a row alone otherwise), then the prefill chunks'
    positions in tiles (`prefill_tiles`)."""

    token_rows: torch.Tensor | slice  # [S] rows of the query / output, in chunk order
    chunk_start: torch.Tensor  # [C + 1] int64
    chunk_shared: torch.Tensor  # [C] int32 tokens of the chunk's shared prefix
    q_rows: torch.Tensor  # [S] int64 rows of the query, in chunk order
    table_rows: torch.Tensor  # [S] int64 rows of the block tables
    ctx_lens: torch.Tensor  # [S] int32


def native_chunks(shared: list[tuple[list[int], int]], num_rows: int, max_rows: int,
                  ) -> list[tuple[list[int], int]]:
    """(rows, shared blocks) per chunk: each shared group split into near-equal chunks of
    at most `max_rows` rows, then every other row alone (0 shared blocks)."""
    chunks, grouped = [], set()
    for rows, run in shared:
        parts = -(-len(rows) // max_rows)
        for k in range(parts):
            chunks.append((rows[k * len(rows) // parts:(k + 1) * len(rows) // parts], run))
        grouped.update(rows)
    return chunks + [([r], 0) for r in range(num_rows) if r not in grouped]


@dataclass(slots=True)
class CascadePlan:
    """The batch as `cascade_attention_reference` attends it (`plan_cascade`)."""

    decodes: _SeqGroup | None  # every decode row, keys from its prefix's end on
    prefixes: list[_Prefix]
    prefills: list[_SeqGroup]
    # decodes.mask as an additive float mask (0 / -inf), which the fused CPU kernel needs;
    # None when no row is padded (every row attends all L gathered keys)
    decode_bias: torch.Tensor | None = None  # [S_d, 1, group, L] float32


def find_prefixes(
    tables: torch.Tensor,  # [S_d, max_blocks] int32 block tables of the decode rows
    ctx: list[int],  # [S_d] context lengths
    block_size: int,
    min_prefix_blocks: int,
) -> tuple[list[int], list[tuple[list[int], int]]]:
    """(first suffix block of each row, [(rows, prefix blocks)] of each shared group).

    Rows are grouped by first block id; a group of two or more rows shares the longest
    common leading run of its tables, at most (min ctx - 1) // block_size blocks so every
    row has a suffix token; groups sharing fewer than `min_prefix_blocks` blocks are not
    cascaded (their rows attend everything in the suffix call)."""
    by_first: dict[int, list[int]] = {}
    for row, block in enumerate(tables[:, 0].tolist()):
        if block >= 0:
            by_first.setdefault(block, []).append(row)
    first = [0] * len(ctx)
    groups = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        cap = (min(ctx[r] for r in rows) - 1) // block_size
        if cap < min_prefix_blocks:
            continue
        sub = tables[rows, :cap]  # [G, cap]
        same = (sub == sub[:1]).all(0)  # [cap] column shared by every row
        run = int(same.long().cumprod(0).sum())
        if run < min_prefix_blocks:
            continue
        for r in rows:
            first[r] = run
        groups.append((rows, run))
    return first, groups


def prefill_tiles(positions: range, max_rows: int) -> list[range]:
    """A prefill chunk's query positions as tiles of at most `max_rows` consecutive ones,
    the last (longest) tile first: tile [p, p + R) attends tokens [0, p) as a shared prefix
    and row p + r its own [p, p + r] (causal), so `native.decode_attention` computes the
    causal half and nothing of the masked one; the costly tiles start first."""
    tiles = [positions[k:k + max_rows] for k in range(0, len(positions), max_rows)]
    return tiles[::-1]


def _native_rows(decode_chunks: list[tuple[list[int], int]], decode_idx: list[int],
                 num_q: list[int], starts: list[int], ctx: list[int], block_size: int,
                 max_rows: int, device: torch.device) -> NativeRows:
    """Every row of the step as `native.decode_attention` chunks: the decode chunks, then
    each prefill chunk's tiles (`prefill_tiles`)."""
    q_rows, table_rows, ctx_lens, sizes, shared = [], [], [], [], []
    for chunk, run in decode_chunks:
        seqs = [decode_idx[r] for r in chunk]
        q_rows += [starts[i] for i in seqs]
        table_rows += seqs
        ctx_lens += [ctx[i] for i in seqs]
        sizes.append(len(seqs))
        shared.append(run * block_size)
    for i, n in enumerate(num_q):
        if n <= 1:
            continue
        first_pos = ctx[i] - n  # the chunk's first query position
        for tile in prefill_tiles(range(first_pos, ctx[i]), max_rows):
            q_rows += [starts[i] + p - first_pos for p in tile]
            table_rows += [i] * len(tile)
            ctx_lens += [p + 1 for p in tile]
            sizes.append(len(tile))
            shared.append(tile.start)
    return NativeRows(
        _rows(q_rows, device), torch.tensor([0, *itertools.accumulate(sizes)]),
        torch.tensor(shared, dtype=torch.int32), torch.tensor(q_rows, dtype=torch.int64),
        torch.tensor(table_rows, dtype=torch.int64), torch.tensor(ctx_lens, dtype=torch.int32))


def _decode_rows(num_q: list[int], ctx: list[int], block_tables: torch.Tensor,
                 block_size: int, min_prefix_blocks: int,
                 ) -> tuple[list[int], torch.Tensor, list[int], list[tuple[list[int], int]]]:
    """(decode sequences, their host block tables [S_d, W], first suffix block of each,
    shared groups) as `find_prefixes` gives them."""
    decode_idx = [i for i, n in enumerate(num_q) if n == 1]
    if not decode_idx:
        return decode_idx, block_tables[:0].cpu(), [], []
    tables = block_tables[torch.tensor(decode_idx, device=block_tables.device)].cpu()
    first, shared = find_prefixes(tables, [ctx[i] for i in decode_idx], block_size,
                                  min_prefix_blocks)
    return decode_idx, tables, first, shared


def plan_native(
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
    block_size: int, group: int, max_query_len: int, max_context_len: int,
    min_prefix_blocks: int = MIN_PREFIX_BLOCKS,
) -> NativeRows:
    """Every row of the batch as `native_attention` takes them: the decode rows in chunks
    of rows sharing a prefix (`find_prefixes`, `native_chunks`), then each prefill chunk's
    tiles (`prefill_tiles`). A host sync: computed once per step (`Ops.plan`)."""
    starts, ctx, num_q = split_batch(cu_seqlens_q, context_lens, max_query_len,
                                     max_context_len)
    max_rows = native.max_chunk_rows(group)
    decode_idx, _, _, shared = _decode_rows(num_q, ctx, block_tables, block_size,
                                            min_prefix_blocks)
    chunks = native_chunks(shared, len(decode_idx), max_rows) if decode_idx else []
    return _native_rows(chunks, decode_idx, num_q, starts, ctx, block_size, max_rows,
                        block_tables.device)


def plan_cascade(
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
    block_size: int, group: int, max_query_len: int, max_context_len: int,
    min_prefix_blocks: int = MIN_PREFIX_BLOCKS,
) -> CascadePlan:
    """The batch as the plain-torch `cascade_attention_reference` attends it. A host sync:
    computed once per step (`Ops.plan`)."""
    starts, ctx, num_q = split_batch(cu_seqlens_q, context_lens, max_query_len,
                                     max_context_len)
    device = block_tables.device
    prefills = prefill_groups(num_q, starts, ctx, block_tables, block_size, group)
    decode_idx, tables, first, shared = _decode_rows(num_q, ctx, block_tables, block_size,
                                                     min_prefix_blocks)
    if not decode_idx:
        return CascadePlan(None, [], prefills)
    decodes = decode_group(decode_idx, starts, ctx, block_tables, block_size, group, first)
    prefixes = []
    for rows, run in shared:
        ids = tables[rows[0], :run].tolist()
        consecutive = ids == list(range(ids[0], ids[0] + run))
        prefixes.append(_Prefix(_rows(rows, device), len(rows),
                                torch.tensor(ids, dtype=torch.int64, device=device),
                                max(ctx[decode_idx[r]] for r in rows) - 1,
                                ids[0] if consecutive else None))
    bias = None
    if prefixes and not bool(decodes.mask.all()):
        bias = torch.zeros(decodes.mask.shape, device=device).masked_fill_(
            ~decodes.mask, float("-inf"))
    return CascadePlan(decodes, prefixes, prefills, bias)


def native_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32, heads dense
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] f32 or bf16
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] as k_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padding = -1
    rows: NativeRows,  # `plan_native` of this batch
    scale: float,
    compute_dtype: torch.dtype = torch.float32,  # or torch.bfloat16
    window: int = 0,  # > 0: sliding window (reference.py); 0: full causal
    softcap: float = 0.0,  # > 0: logit softcap after the scale; 0: none
    prompt_rows: bool = False,  # every row a prompt row: native.decode_attention's
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float32
    """The batch's attention (the contract of `paged_attention_reference`, `window` and
    `softcap` included) in one native call, from the cache blocks in place (bfloat16 caches
    widened to float32 as read; with `compute_dtype` bfloat16, every token through bf16
    dot products: `native.decode_attention`)."""
    in_order = rows.token_rows == slice(0, query.shape[0])  # every row, in chunk order
    return native.decode_attention(
        query, k_cache, v_cache, block_tables.int().contiguous(), rows.chunk_start,
        rows.chunk_shared, rows.q_rows, rows.table_rows, rows.ctx_lens, scale,
        out_rows=None if in_order else rows.q_rows, compute_dtype=compute_dtype,
        window=window, softcap=softcap, prompt_rows=prompt_rows)


def attend_with_lse(
    query: torch.Tensor,  # [S, Q, H, D]
    key: torch.Tensor,  # [S, L, H_kv, D]
    value: torch.Tensor,  # [S, L, H_kv, D]
    bias: torch.Tensor | None,  # [S, 1, group * Q, L] float32, 0 = attend, -inf = not
    scale: float,
    softcap: float = 0.0,  # > 0: scores capped as `reference.capped_scores`
    empty_rows: bool = False,  # whether `bias` may mask every key of a query
) -> tuple[torch.Tensor, torch.Tensor]:  # [S, Q, H, D] float32, [S, Q, H] float32
    """Grouped-query attention (as `reference._attend`) that also returns each query's
    log-sum-exp of its (capped) scaled scores, in float32; `bias` None attends every key.
    Unless `empty_rows`, every query must attend >= 1 key; with it, a query that attends
    none gets output 0 and log-sum-exp -inf (its weight in `_merge`: 0)."""
    num_seqs, num_q, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.view(num_seqs, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * num_q, head_dim).float()
    k, v = key.transpose(1, 2).float(), value.transpose(1, 2).float()  # [S, H_kv, L, D]
    if query.device.type == "cpu" and _HAS_FLASH_CPU and softcap == 0 and not empty_rows:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    else:
        scores = capped_scores(q @ k.transpose(-1, -2), scale, softcap)  # [S, H_kv, G*Q, L]
        if bias is not None:
            scores = scores + bias
        lse = scores.logsumexp(-1)  # [S, H_kv, group * Q]
        if empty_rows:  # e^(-inf - 0) = 0: no NaN from -inf - -inf
            out = torch.exp(scores - lse.clamp_min(torch.finfo(lse.dtype).min)[..., None]) @ v
        else:
            out = torch.exp(scores - lse[..., None]) @ v
    out = out.reshape(num_seqs, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
    lse = lse.reshape(num_seqs, num_kv_heads, group, num_q).permute(0, 3, 1, 2)
    return (out.reshape(num_seqs, num_q, num_heads, head_dim),
            lse.reshape(num_seqs, num_q, num_heads))


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted merge of two partial attentions over disjoint key sets.

    out_*: [R, H, D], lse_*: [R, H] (float32). Returns [R, H, D]:
    (e^a out_a + e^b out_b) / (e^a + e^b) = out_b + sigmoid(a - b) (out_a - out_b)."""
    return torch.lerp(out_b, out_a, torch.sigmoid(lse_a - lse_b).unsqueeze(-1))


def _prefix_kv(cache: torch.Tensor, prefix: _Prefix) -> torch.Tensor:  # [1, P, H_kv, D]
    """The prefix's cached K (or V): a view of `cache` when its blocks are consecutive."""
    num_blocks, block_size = prefix.block_ids.shape[0], cache.shape[1]
    if prefix.first_block is not None:
        blocks = cache[prefix.first_block : prefix.first_block + num_blocks]
        return blocks.view(1, num_blocks * block_size, *cache.shape[2:])
    return gather_blocks(cache, prefix.block_ids, 1, num_blocks * block_size)


def cascade_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padding = -1
    scale: float,
    max_query_len: int,
    max_context_len: int,
    min_prefix_blocks: int = MIN_PREFIX_BLOCKS,
    plan: CascadePlan | None = None,  # `plan_cascade` of this batch; None: made here
    window: int = 0,  # > 0: sliding window (reference.py); 0: full causal
    softcap: float = 0.0,  # > 0: logit softcap after the scale; 0: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract and result as `paged_attention_reference` (`window` and `softcap`
    included), in plain torch; decode rows that share a leading run of at least
    `min_prefix_blocks` blocks attend it once per group (with a window that reaches into
    it: each row masked to its own window, `_prefix_bias`)."""
    check_variants(window, softcap)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    if plan is None:
        plan = plan_cascade(cu_seqlens_q, context_lens, block_tables, block_size, group,
                            max_query_len, max_context_len, min_prefix_blocks)
    out = torch.empty_like(query)
    for g in plan.prefills:
        key = gather_blocks(k_cache, g.block_ids, 1, g.length)
        value = gather_blocks(v_cache, g.block_ids, 1, g.length)
        q = query[g.token_idx].view(1, g.num_q, -1, head_dim)
        attended = _attend(q, key, value, window_mask(g, window), scale, softcap)
        out[g.token_idx] = attended.view(-1, *query.shape[1:])
    d = plan.decodes
    if d is None:
        return out
    q = query[d.token_idx].view(d.num_seqs, 1, -1, head_dim)  # [S_d, 1, H, D]
    key = gather_blocks(k_cache, d.block_ids, d.num_seqs, d.length)
    value = gather_blocks(v_cache, d.block_ids, d.num_seqs, d.length)
    if not plan.prefixes:
        attended = _attend(q, key, value, window_mask(d, window), scale, softcap)
        out[d.token_idx] = attended.view(-1, *query.shape[1:])
        return out
    bias = plan.decode_bias
    if window > 0:  # the suffix keys before each row's window masked too
        bias = torch.zeros(d.mask.shape, device=q.device).masked_fill_(
            ~window_mask(d, window), float("-inf"))
    dec, lse = attend_with_lse(q, key, value, bias, scale, softcap)
    dec, lse = dec.squeeze(1), lse.squeeze(1)  # [S_d, H, D], [S_d, H]
    for p in plan.prefixes:
        key, value = _prefix_kv(k_cache, p), _prefix_kv(v_cache, p)
        pre_bias = _prefix_bias(p, d, key.shape[1], group, window)
        # the group's queries stacked as one sequence's queries: [1, G, H, D]
        pre, pre_lse = attend_with_lse(q[p.rows].view(1, p.num_rows, -1, head_dim), key,
                                       value, pre_bias, scale, softcap,
                                       empty_rows=pre_bias is not None)
        dec[p.rows] = _merge(dec[p.rows], lse[p.rows], pre[0], pre_lse[0])
    out[d.token_idx] = dec.to(query.dtype)
    return out


def _prefix_bias(prefix: _Prefix, decodes: _SeqGroup, length: int, group: int,
                 window: int) -> torch.Tensor | None:  # [1, 1, group * G, P] float32
    """The additive mask of a shared prefix's call for its G rows stacked (rows ordered
    (head in group, row), as `attend_with_lse` stacks them): prefix key k is attended by a
    row at position p iff p - k < window. None without a window, or when every row's
    window reaches back to token 0 (each attends all of the prefix: no mask)."""
    if window <= 0 or prefix.max_pos < window:
        return None
    q_pos = decodes.q_pos.view(-1)[prefix.rows]  # [G]
    keys = torch.arange(length, device=q_pos.device)  # [P]
    allowed = q_pos[:, None] - keys[None, :] < window  # [G, P]
    bias = torch.zeros(allowed.shape, device=q_pos.device).masked_fill_(~allowed,
                                                                          float("-inf"))
    return bias.repeat(group, 1)[None, None]
