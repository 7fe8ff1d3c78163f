"""The plain-torch reference kernels against direct computations without paging.

`paged_attention_reference` is compared with float64 dense causal attention computed from
the per-sequence K/V that `kernel_cases.build_batch` scattered into the paged cache at
shuffled block ids; `write_kv_reference` with direct indexing of the flattened cache.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernel_cases import (
    LARGE_FIRST_BLOCK_ID,
    MIXED_SEQS,
    BatchSpec,
    build_batch,
    build_write_case,
    dense_attention,
)

from plait.kernels.reference import paged_attention_reference, write_kv_reference

# (atol, rtol) against float64; the reference computes in fp32 and rounds once at the end
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _check_against_dense(spec: BatchSpec) -> None:
    batch = build_batch(spec)
    got = paged_attention_reference(**batch.kernel_args())
    assert got.shape == batch.query.shape and got.dtype == spec.dtype
    atol, rtol = TOLERANCES[spec.dtype]
    torch.testing.assert_close(got.double(), dense_attention(batch), atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_batch_matches_dense(block_size, group):
    _check_against_dense(
        BatchSpec(MIXED_SEQS, num_heads=2 * group, num_kv_heads=2, block_size=block_size)
    )


@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param(((1, 1), (1, 9), (1, 16), (1, 17), (1, 100)), id="decode_only"),
        pytest.param(((24, 24), (1, 1), (16, 16)), id="full_prefill"),
        pytest.param(((8, 40), (3, 17), (16, 32)), id="prefill_after_cached_prefix"),
    ],
)
@pytest.mark.parametrize("block_size", [1, 16])
def test_batch_kinds_match_dense(seqs, block_size):
    _check_against_dense(BatchSpec(seqs, num_heads=6, num_kv_heads=2, block_size=block_size))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_dense(dtype):
    _check_against_dense(BatchSpec(MIXED_SEQS, num_heads=8, num_kv_heads=2, dtype=dtype))


def test_wrong_causal_offset_is_detected():
    """Attending one key too many or too few must fail the tolerance used above."""
    batch = build_batch(BatchSpec(MIXED_SEQS, num_heads=4, num_kv_heads=2, block_size=8))
    got = paged_attention_reference(**batch.kernel_args()).double()
    atol, rtol = TOLERANCES[torch.float32]
    for shift in (1, -1):
        wrong = dense_attention(batch, causal_shift=shift)
        assert not torch.allclose(got, wrong, atol=atol, rtol=rtol, equal_nan=True)


def test_block_ids_past_int32_element_offsets():
    """block_id * block stride > 2**31 elements; the untouched cache below stays virtual."""
    spec = BatchSpec(
        ((1, 40), (9, 33), (16, 16)), num_heads=2, num_kv_heads=1, head_dim=16,
        dtype=torch.float16, first_block_id=LARGE_FIRST_BLOCK_ID,
    )
    batch = build_batch(spec)
    block_stride = batch.k_cache.stride(0)
    assert int(batch.block_tables[batch.block_tables >= 0].min()) * block_stride > 2**31
    _check_against_dense(spec)


@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_dim, block_size, cache_dtype, first_block_id",
    [
        (13, 2, 48, 8, torch.float16, 0),
        (9, 3, 16, 1, torch.float32, 0),
        (10, 1, 16, 16, torch.float16, LARGE_FIRST_BLOCK_ID),
    ],
)
def test_write_kv_matches_direct_indexing(
    num_tokens, num_kv_heads, head_dim, block_size, cache_dtype, first_block_id
):
    inputs = build_write_case(
        num_tokens, num_kv_heads, head_dim, block_size, cache_dtype, first_block_id
    )
    slots, key, value = inputs["slot_mapping"], inputs["key"], inputs["value"]
    k_cache, v_cache = inputs["k_cache"], inputs["v_cache"]
    valid = slots >= 0
    assert (~valid).any() and valid.any()
    before = [c[first_block_id:].clone() for c in (k_cache, v_cache)]  # the touched range
    write_kv_reference(**inputs)
    for cache, old, new in zip((k_cache, v_cache), before, (key, value), strict=True):
        expected = old.clone()  # [num_used, block_size, H_kv, D]
        local = slots[valid] - first_block_id * block_size
        expected.view(-1, num_kv_heads, head_dim)[local] = new[valid].to(cache_dtype)
        assert torch.equal(cache[first_block_id:], expected)
    assert not torch.equal(k_cache[first_block_id:], before[0])  # something was written
