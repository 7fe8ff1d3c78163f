"""Shared-prefix (cascade) attention: equals plain paged attention and dense attention on
random batches of shared groups, singletons and prefills, and finds exactly the groups."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.kernel_cases import BatchSpec, build_batch, dense_attention, share_prefix

from plait.kernels.cpu import attention as cascade
from plait.kernels.cpu import build, native
from plait.kernels.cpu.attention import (
    cascade_attention_reference,
    find_prefixes,
    native_attention,
    plan_cascade,
    plan_native,
)
from plait.kernels.reference import paged_attention_reference


def _plan(batch, min_prefix_blocks: int = cascade.MIN_PREFIX_BLOCKS) -> cascade.CascadePlan:
    """`plan_cascade` of `batch`, as the ops table computes it once per step."""
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    return plan_cascade(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                        block_size, batch.query.shape[1] // num_kv_heads,
                        batch.max_query_len, batch.max_context_len, min_prefix_blocks)


def _native(batch, min_prefix_blocks: int) -> torch.Tensor | None:
    """The batch through the native kernel's path (`plan_native`, `native_attention`), as
    `CpuNativeOps` attends it; None where the kernels are not built here or do not take
    this geometry."""
    _, block_size, num_kv_heads, head_dim = batch.k_cache.shape
    num_heads = batch.query.shape[1]
    if not (build.available() and batch.query.dtype == torch.float32
            and native.supports_attention(num_heads, num_kv_heads, head_dim, block_size)):
        return None
    rows = plan_native(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                       block_size, num_heads // num_kv_heads, batch.max_query_len,
                       batch.max_context_len, min_prefix_blocks)
    return native_attention(batch.query.contiguous(), batch.k_cache, batch.v_cache,
                            batch.block_tables, rows, batch.scale)


def _random_case(seed: int, block_size: int) -> tuple[BatchSpec, list[tuple[list[int], int]]]:
    """Decodes (some in shared groups of 2-5 rows), singletons and prefill chunks, shuffled."""
    rng = random.Random(seed)
    seqs: list[tuple[int, int]] = []
    shares = []
    for _ in range(rng.randint(1, 3)):  # shared groups
        num_shared = rng.randint(1, 5)
        rows = list(range(len(seqs), len(seqs) + rng.randint(2, 5)))
        min_ctx = num_shared * block_size + 1
        seqs += [(1, rng.randint(min_ctx, min_ctx + 3 * block_size)) for _ in rows]
        shares.append((rows, num_shared))
    seqs += [(1, rng.randint(1, 5 * block_size)) for _ in range(rng.randint(0, 3))]
    seqs += [(n, n + rng.randint(0, 40)) for n in rng.sample(range(2, 30), rng.randint(0, 2))]
    order = list(range(len(seqs)))
    rng.shuffle(order)
    where = {old: new for new, old in enumerate(order)}
    spec = BatchSpec(seqs=tuple(seqs[i] for i in order), num_heads=6, num_kv_heads=2,
                     head_dim=32, block_size=block_size, seed=seed)
    return spec, [([where[r] for r in rows], n) for rows, n in shares]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seed", range(8))
def test_random_batches_match_paged_and_dense_attention(seed, block_size):
    spec, shares = _random_case(seed, block_size)
    batch = build_batch(spec)
    for rows, num_blocks in shares:
        share_prefix(batch, rows, num_blocks, block_size)
    plain = paged_attention_reference(**batch.kernel_args())
    plan = _plan(batch, min_prefix_blocks=1)
    assert plan.prefixes, "the case must exercise a shared prefix"
    shared = cascade_attention_reference(**batch.kernel_args(), min_prefix_blocks=1,
                                         plan=plan)
    # the plan computed inside (plan=None) is the same one
    torch.testing.assert_close(
        cascade_attention_reference(**batch.kernel_args(), min_prefix_blocks=1), shared,
        atol=0, rtol=0)
    torch.testing.assert_close(shared, plain, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(shared.double(), dense_attention(batch), atol=2e-6, rtol=1e-5)
    natively = _native(batch, min_prefix_blocks=1)
    if natively is not None:  # the same batch through the native backend's seam
        torch.testing.assert_close(natively, plain, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(natively.double(), dense_attention(batch), atol=2e-6,
                                   rtol=1e-5)


def _renumber_blocks(batch, first: list[int]) -> None:
    """Relabel cache blocks in place so the blocks listed in `first` get ids 0, 1, ... in
    that order (the rest follow): the same batch, with those blocks consecutive."""
    used = list(first)
    used += [b for b in range(batch.k_cache.shape[0]) if b not in set(first)]
    new_of = torch.empty(len(used), dtype=torch.int64)
    new_of[torch.tensor(used)] = torch.arange(len(used))
    for cache in (batch.k_cache, batch.v_cache):
        cache[new_of] = cache.clone()
    valid = batch.block_tables >= 0
    batch.block_tables[valid] = new_of[batch.block_tables[valid].long()].to(torch.int32)


@pytest.mark.parametrize("equal_lengths", [True, False])
def test_consecutive_prefix_blocks_are_attended_as_a_view(equal_lengths):
    """A prefix whose blocks are consecutive ids (a prompt allocated at once) is read as a
    view of the cache, and rows of one length need no mask: the same result as the gather
    path and as dense attention."""
    lengths = (37, 37, 37, 37) if equal_lengths else (37, 35, 40, 33)
    batch = build_batch(BatchSpec(seqs=tuple((1, n) for n in lengths), block_size=4))
    share_prefix(batch, [0, 1, 2, 3], 8, 4)
    plan = _plan(batch, min_prefix_blocks=1)
    assert [p.first_block for p in plan.prefixes] == [None]  # random block ids
    gathered = cascade_attention_reference(**batch.kernel_args(), min_prefix_blocks=1,
                                           plan=plan)
    _renumber_blocks(batch, batch.block_tables[0, :8].tolist())
    plan = _plan(batch, min_prefix_blocks=1)  # the block tables changed: plan again
    assert [p.first_block for p in plan.prefixes] == [0]
    viewed = cascade_attention_reference(**batch.kernel_args(), min_prefix_blocks=1,
                                         plan=plan)
    assert (plan.decode_bias is None) == equal_lengths
    torch.testing.assert_close(viewed, gathered, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(viewed.double(), dense_attention(batch), atol=2e-6, rtol=1e-5)


def test_plain_torch_fallback_matches_the_fused_cpu_kernel(monkeypatch):
    spec, shares = _random_case(3, 4)
    batch = build_batch(spec)
    for rows, num_blocks in shares:
        share_prefix(batch, rows, num_blocks, 4)
    plan = _plan(batch, min_prefix_blocks=1)
    assert plan.prefixes, "the case must exercise a shared prefix"
    fused = cascade_attention_reference(**batch.kernel_args(), plan=plan)
    monkeypatch.setattr(cascade, "_HAS_FLASH_CPU", False)
    fallback = cascade_attention_reference(**batch.kernel_args(), plan=plan)
    torch.testing.assert_close(fallback, fused, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_plain_reference(dtype):
    spec = BatchSpec(seqs=((1, 40), (1, 37), (1, 50)), block_size=4, dtype=dtype)
    batch = build_batch(spec)
    share_prefix(batch, [0, 1, 2], 8, 4)
    plain = paged_attention_reference(**batch.kernel_args())
    shared = cascade_attention_reference(**batch.kernel_args(), min_prefix_blocks=1)
    assert shared.dtype == dtype
    torch.testing.assert_close(shared.float(), plain.float(), atol=1e-2, rtol=1e-2)


def test_groups_are_the_longest_shared_run_capped_to_leave_a_suffix_token():
    # block_size 4. Rows 0-2 share [5 6 7] then diverge; row 3 shares only block 5 with
    # them, so the group's run is 1 block; rows 4-5 share [9 8] but row 5 has 8 tokens,
    # so the cap is (8 - 1) // 4 = 1 block; row 6 is alone.
    tables = torch.tensor([
        [5, 6, 7, 1, -1], [5, 6, 7, 2, -1], [5, 6, 7, 3, 4], [5, 0, -1, -1, -1],
        [9, 8, 10, -1, -1], [9, 8, -1, -1, -1], [11, -1, -1, -1, -1]], dtype=torch.int32)
    ctx = [13, 14, 17, 6, 10, 8, 3]
    first, groups = find_prefixes(tables, ctx, 4, min_prefix_blocks=1)
    assert groups == [([0, 1, 2, 3], 1), ([4, 5], 1)]
    assert first == [1, 1, 1, 1, 1, 1, 0]
    first, groups = find_prefixes(tables[:3], ctx[:3], 4, min_prefix_blocks=1)
    assert groups == [([0, 1, 2], 3)] and first == [3, 3, 3]
    assert find_prefixes(tables[:3], ctx[:3], 4, min_prefix_blocks=4) == ([0, 0, 0], [])


def test_batch_without_shared_blocks_is_the_plain_decode_path():
    batch = build_batch(BatchSpec(seqs=((1, 30), (1, 12), (3, 9))))
    plan = _plan(batch, min_prefix_blocks=1)
    assert plan.prefixes == [] and plan.decode_bias is None
    shared = cascade_attention_reference(**batch.kernel_args(), plan=plan)
    torch.testing.assert_close(shared, paged_attention_reference(**batch.kernel_args()))
