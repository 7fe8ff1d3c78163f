"""Shared builders and case tables for the kernel tests (also used by the interpreter worker).

`build_batch` makes a paged batch whose K/V are known densely per sequence: random K/V
are scattered into a cache at shuffled block ids and every other slot holds garbage
(large values, or NaN), so reading a wrong slot shows up in the output. `dense_attention`
is the float64 ground truth computed straight from the dense K/V, with no paging and no SDPA.

    spec.seqs = [(num_q, context_len), ...]     block_size = 4, ctx = 10:
    cache block ids of a sequence: shuffled     table row: [7, 2, 11, -1, -1]
                                                block 11:  [t8, t9, junk, junk]

With `first_block_id` set, block ids start there; the cache below it is allocated with
`torch.empty` and never touched, so the OS backs only the pages in use. That is how the
tests get block_id * stride past 2**31 elements on a small machine.
"""

from __future__ import annotations

import dataclasses

import torch

# Smallest block id whose first element sits past 2**31 with block_size 16, 1 KV head and
# head_dim 16 (256 elements per block). The cache is then ~4.3 GB of fp16, mostly virtual.
LARGE_FIRST_BLOCK_ID = 2**31 // 256 + 5


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Shape of a test batch; `seqs` lists (num_q, context_len) per sequence."""

    seqs: tuple[tuple[int, int], ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    seed: int = 0
    nan_garbage: bool = False  # unused slots hold NaN instead of large finite values
    strided_query: bool = False  # query is a view into a wider fused QKV tensor
    first_block_id: int = 0


@dataclasses.dataclass
class PagedBatch:
    """Kernel inputs plus the dense per-sequence K/V they were built from."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padding = -1
    keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    scale: float
    max_query_len: int
    max_context_len: int

    def kernel_args(self) -> dict:
        """Keyword arguments of `paged_attention_*` for this batch."""
        return dict(
            query=self.query, k_cache=self.k_cache, v_cache=self.v_cache,
            cu_seqlens_q=self.cu_seqlens_q, context_lens=self.context_lens,
            block_tables=self.block_tables, scale=self.scale,
            max_query_len=self.max_query_len, max_context_len=self.max_context_len,
        )


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _paged_cache(spec: BatchSpec, num_used: int, gen: torch.Generator) -> torch.Tensor:
    """[first_block_id + num_used, block_size, H_kv, D]; only blocks >= first_block_id set."""
    shape = (num_used, spec.block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.empty((spec.first_block_id + num_used, *shape[1:]), dtype=spec.dtype)
    if spec.nan_garbage:
        cache[spec.first_block_id :] = float("nan")
    else:
        cache[spec.first_block_id :] = torch.randn(shape, generator=gen) * 10.0 + 5.0
    return cache


def build_batch(spec: BatchSpec) -> PagedBatch:
    """Deterministic (seeded, CPU) paged batch for `spec`."""
    gen = torch.Generator().manual_seed(spec.seed)
    bs, h_kv, dim = spec.block_size, spec.num_kv_heads, spec.head_dim
    blocks_per_seq = [_cdiv(ctx, bs) for _, ctx in spec.seqs]
    num_used = sum(blocks_per_seq) + 3  # 3 spare blocks nobody owns
    block_ids = torch.randperm(num_used, generator=gen) + spec.first_block_id  # [num_used]
    k_cache, v_cache = _paged_cache(spec, num_used, gen), _paged_cache(spec, num_used, gen)
    max_blocks = max(blocks_per_seq, default=1)
    block_tables = torch.full((len(spec.seqs), max_blocks), -1, dtype=torch.int32)
    keys, values, cursor = [], [], 0
    for s, (_, ctx) in enumerate(spec.seqs):
        ids = block_ids[cursor : cursor + blocks_per_seq[s]]
        cursor += blocks_per_seq[s]
        block_tables[s, : len(ids)] = ids.to(torch.int32)
        keys.append(torch.randn(ctx, h_kv, dim, generator=gen).to(spec.dtype))
        values.append(torch.randn(ctx, h_kv, dim, generator=gen).to(spec.dtype))
        pos = torch.arange(ctx)
        slots = ids[pos // bs] * bs + pos % bs  # [ctx]
        k_cache.view(-1, h_kv, dim)[slots] = keys[-1]
        v_cache.view(-1, h_kv, dim)[slots] = values[-1]
    num_q = [n for n, _ in spec.seqs]
    cu = torch.tensor([0, *num_q], dtype=torch.int64).cumsum(0).to(torch.int32)
    q_shape = (int(cu[-1]), spec.num_heads, dim)
    query = torch.randn(q_shape, generator=gen).to(spec.dtype)  # [T, H, D]
    if spec.strided_query:  # the query part of a fused [T, (H + 2 H_kv) D] projection
        fused = torch.zeros(q_shape[0], (spec.num_heads + 2 * h_kv) * dim, dtype=spec.dtype)
        fused[:, : spec.num_heads * dim] = query.flatten(1)
        query = fused[:, : spec.num_heads * dim].view(q_shape)
    return PagedBatch(
        query=query, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu,
        context_lens=torch.tensor([c for _, c in spec.seqs], dtype=torch.int32),
        block_tables=block_tables, keys=keys, values=values, scale=dim**-0.5,
        max_query_len=max(num_q, default=0),
        max_context_len=max((c for _, c in spec.seqs), default=0),
    )


def dense_attention(batch: PagedBatch, causal_shift: int = 0, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Float64 causal attention from the dense K/V: [num_tokens, num_heads, head_dim].

    `causal_shift` moves every query's position (tests use it to show that an off-by-one
    causal offset is detected). `window` > 0: the query at p attends only keys k with
    0 <= p - k < window (an explicit mask); `softcap` > 0: scores s = scale q.k become
    softcap * tanh(s / softcap) before the softmax.
    """
    num_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = batch.cu_seqlens_q.tolist()
    for s, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        group = num_heads // key.shape[1]
        k = key.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = value.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        q = batch.query[starts[s] : starts[s + 1]].double()  # [n, H, D]
        ctx, n = k.shape[0], q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale  # [H, n, ctx]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - n, ctx) + causal_shift  # [n]
        k_pos = torch.arange(ctx)  # [ctx]
        allowed = k_pos[None, :] <= q_pos[:, None]  # [n, ctx]
        if window > 0:
            allowed &= q_pos[:, None] - k_pos[None, :] < window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[starts[s] : starts[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def build_write_case(
    num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
    cache_dtype: torch.dtype, first_block_id: int = 0, seed: int = 0,
    exact_in_cache_dtype: bool = False,
) -> dict[str, torch.Tensor]:
    """Inputs of `write_kv_*`: fp32 K/V viewed out of a fused QKV tensor (strided), a
    garbage-filled cache and distinct random slots with every third token set to -1.
    `exact_in_cache_dtype` makes the fp32 values representable in the cache dtype, so
    the cast cannot round (the interpreter truncates fp32 -> bf16; GPUs round to even)."""
    gen = torch.Generator().manual_seed(seed)
    width = num_kv_heads * head_dim
    fused = torch.randn(num_tokens, 3 * width, generator=gen)  # [T, 3 * H_kv * D]
    if exact_in_cache_dtype:
        fused = fused.to(cache_dtype).float()
    num_used = _cdiv(num_tokens, block_size) + 2
    shape = (first_block_id + num_used, block_size, num_kv_heads, head_dim)
    caches = [torch.empty(shape, dtype=cache_dtype) for _ in range(2)]
    for cache in caches:
        cache[first_block_id:] = torch.randn(cache[first_block_id:].shape, generator=gen)
    slots = torch.randperm(num_used * block_size, generator=gen)[:num_tokens]
    slots += first_block_id * block_size
    slots[::3] = -1
    return dict(
        key=fused[:, width : 2 * width].view(num_tokens, num_kv_heads, head_dim),
        value=fused[:, 2 * width :].view(num_tokens, num_kv_heads, head_dim),
        k_cache=caches[0], v_cache=caches[1], slot_mapping=slots,
    )


# Mixed batch: decode at ctx 1, decode mid-block, full prefill, prefill after a cached
# prefix, decode at an exact block multiple, a 2-token chunk after a prefix.
MIXED_SEQS = ((1, 1), (1, 37), (20, 20), (7, 45), (1, 64), (2, 19))


def share_prefix(batch: PagedBatch, rows: list[int], num_blocks: int, block_size: int) -> None:
    """Make `rows` share the first `num_blocks` blocks of `rows[0]`, in place: their table
    entries point at rows[0]'s blocks and their dense K/V take rows[0]'s prefix values, so
    the ground truth still matches the cache (their own old prefix blocks become orphans).

        before: row a [a0 a1 a2]   row b [b0 b1 b2]   after (num_blocks 2): row b [a0 a1 b2]
    """
    owner, prefix = rows[0], num_blocks * block_size
    for r in rows[1:]:
        batch.block_tables[r, :num_blocks] = batch.block_tables[owner, :num_blocks]
        batch.keys[r][:prefix] = batch.keys[owner][:prefix]
        batch.values[r][:prefix] = batch.values[owner][:prefix]


BF16 = torch.bfloat16
U_BF16 = 2.0**-8  # bf16's unit roundoff (round to nearest)


def bf16_batch(group: int, head_dim: int, block_size: int, seed: int = 0) -> PagedBatch:
    """Every path of the kernel, bf16 caches: 12 decode rows sharing 4 blocks (chunks of
    up to 48 query heads), 2 more sharing 5, a lone long row,
    a prefill chunk after a cached prefix and one from position 0 (causal tiles: prefixes of
    any length, odd ones included)."""
    kv_heads = 3 if group == 3 else 2
    seqs = (*((1, 4 * block_size + 5 + 3 * i) for i in range(12)),
            (1, 5 * block_size + 1), (1, 5 * block_size + 9), (1, 333), (45, 173), (30, 30))
    batch = build_batch(BatchSpec(seqs=seqs, num_heads=group * kv_heads, num_kv_heads=kv_heads,
                                  head_dim=head_dim, block_size=block_size, seed=seed))
    share_prefix(batch, list(range(12)), 4, block_size)
    share_prefix(batch, [12, 13], 5, block_size)
    batch.k_cache, batch.v_cache = batch.k_cache.to(BF16), batch.v_cache.to(BF16)
    batch.keys = [k.to(BF16).double() for k in batch.keys]
    batch.values = [v.to(BF16).double() for v in batch.values]
    return batch


def bf16_reference(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 attention, the per-element bound of p's rounding): each row's tokens scored
    with its scaled query rounded to bf16."""
    num_tokens, num_heads, head_dim = batch.query.shape
    scaled = batch.query * torch.tensor(batch.scale, dtype=torch.float32)  # [T, H, D]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    bound = torch.zeros_like(out)
    starts = batch.cu_seqlens_q.tolist()
    for s, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        group = num_heads // key.shape[1]
        k = key.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = value.repeat_interleave(group, dim=1)  # [ctx, H, D]
        ctx = k.shape[0]
        for row in range(starts[s], starts[s + 1]):
            pos = ctx - (starts[s + 1] - row)  # the row's position: it attends [0, pos]
            rounded = torch.einsum("hd,khd->hk", scaled[row].to(BF16).double(), k[:pos + 1])
            w = rounded.softmax(-1)  # [H, pos + 1]
            out[row] = torch.einsum("hk,khd->hd", w, v[:pos + 1])
            spread = (v[:pos + 1].permute(1, 0, 2) - out[row][:, None]).abs()  # [H, k, D]
            bound[row] = torch.einsum("hk,hkd->hd", w, spread) * U_BF16 / (1 - U_BF16)
    return out, bound
