"""A bfloat16 KV cache (`--kv-cache-dtype bfloat16`): every op that writes it stores
torch's `.to(torch.bfloat16)` of the float32 value (round to nearest even), and every op that
reads it computes exactly what it computes over a float32 cache holding the same rounded
values (the values widen to float32 exactly; the arithmetic is float32 either way). The
native kernels (C) and the plain-torch ops (reference, cascade) alike."""

from __future__ import annotations

import pytest
import torch
from helpers.kernel_cases import BatchSpec, build_batch, dense_attention, share_prefix
from helpers.threads import torch_threads

from plait.engine.models.rope import rope_cos_sin
from plait.kernels import AttentionMetadata, AttentionShape, select_ops
from plait.kernels.cpu import build, native
from plait.kernels.cpu.attention import native_attention, plan_native
from plait.kernels.ops import apply_rope
from plait.kernels.reference import paged_attention_reference, write_kv_reference

needs_native = pytest.mark.skipif(not build.available(),
                                  reason="no C compiler / not x86-64: native kernels off")

# float32 bits -> the bfloat16 bits round-to-nearest-even gives (truncation would differ on
# the ties going up, and on 0x3F80FFFF)
ROUNDING = {0x3F808000: 0x3F80,  # a tie, down to the even 0x3F80
            0x3F818000: 0x3F82,  # a tie, up to the even 0x3F82
            0xBF818000: 0xBF82,  # the same, negative
            0x3F80FFFF: 0x3F81,  # above the half: up
            0x3F807FFF: 0x3F80,  # below the half: down
            0x7F7FFFFF: 0x7F80,  # float32's largest: rounds up to +inf
            0x00018000: 0x0002,  # a denormal tie, up to the even
            0x7FC00001: 0x7FC0}  # a NaN stays a NaN (quiet, the payload dropped)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's bits."""
    return t.view(torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 tensors equal bit for bit, but for a NaN, which may be any NaN (torch's
    vectorized conversion writes 0xFFFF, its scalar one 0x7FC0)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _mixed_batch():
    """20 decode rows sharing 4 blocks (chunks of shared rows), two decodes alone, a
    prefill chunk (causal tiles) and a one-token row: every path of the native kernel."""
    seqs = (*((1, 70 + i) for i in range(20)), (1, 33), (5, 20), (1, 1), (1, 600))
    batch = build_batch(BatchSpec(seqs=seqs, num_heads=6, num_kv_heads=2, head_dim=64,
                                  block_size=16, seed=11))
    share_prefix(batch, list(range(20)), 4, 16)
    return batch


def _native(batch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    args = batch.kernel_args()
    rows = plan_native(args["cu_seqlens_q"], args["context_lens"], args["block_tables"],
                       k_cache.shape[1], args["query"].shape[1] // k_cache.shape[2],
                       args["max_query_len"], args["max_context_len"])
    return native_attention(args["query"], k_cache, v_cache, args["block_tables"], rows,
                            args["scale"])


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_native_attention_over_bf16_is_float32_over_the_rounded_values(threads) -> None:
    """Bit for bit the float32 kernel over the rounded caches, through every path (shared
    chunks, long lone rows, prefill tiles); within float32 rounding of dense
    float64 attention over the rounded K/V; and measurably not the unrounded result, so
    the comparison sees whether the cache was rounded."""
    batch = _mixed_batch()
    k16, v16 = batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)
    with torch_threads(threads):
        out = _native(batch, k16, v16)
        widened = _native(batch, k16.float(), v16.float())
        unrounded = _native(batch, batch.k_cache, batch.v_cache)
    assert torch.equal(out, widened)
    batch.keys = [k.to(torch.bfloat16).float() for k in batch.keys]
    batch.values = [v.to(torch.bfloat16).float() for v in batch.values]
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=2e-6, rtol=1e-5)
    assert (out - unrounded).abs().max().item() > 1e-4


@needs_native
def test_native_attention_refuses_caches_it_does_not_take() -> None:
    batch = _mixed_batch()
    with pytest.raises(ValueError, match="KV caches"):  # float16: not a native KV type
        _native(batch, batch.k_cache.half(), batch.v_cache.half())
    with pytest.raises(ValueError, match="KV caches"):  # K and V of different types
        _native(batch, batch.k_cache.to(torch.bfloat16), batch.v_cache)


def _rope_case(num_tokens: int, pad: bool):
    """(q, k, v views of one qkv buffer, cos_sin, positions, slots, bf16 caches); with `pad`
    the last of several tokens has slot -1 (not written)."""
    gen = torch.Generator().manual_seed(num_tokens)
    heads, kv_heads, head_dim = 9, 3, 64
    cos_sin = rope_cos_sin(head_dim, 4096, 10000.0, None)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    # v's first values: the rounding cases, copied to the cache as they are
    v_at = (heads + kv_heads) * head_dim
    qkv[0, v_at:v_at + len(ROUNDING)] = torch.tensor(
        list(ROUNDING), dtype=torch.int64).to(torch.int32).view(torch.float32)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    slots = torch.randperm(40 * 16, generator=gen)[:num_tokens]
    if pad and num_tokens > 1:
        slots[-1] = -1
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
    views = (q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
             v.view(num_tokens, kv_heads, head_dim))
    caches = [torch.randn(40, 16, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
              for _ in range(2)]
    return views, cos_sin, positions, slots, caches


@needs_native
@pytest.mark.parametrize("num_tokens", [1, 16, 100])
def test_rope_write_kv_stores_round_to_nearest_even_of_the_rotated_k(num_tokens) -> None:
    """The fused kernel into bf16 caches: q as the float32 path rotates it, the caches
    exactly `write_kv_reference` of the float32 rotated k and v (torch's rounding), other
    slots untouched; the rounding cases give their round-to-nearest-even bits."""
    (q, k, v), cos_sin, positions, slots, caches = _rope_case(num_tokens, pad=True)
    q_ref, k_ref = apply_rope(cos_sin, positions, q.clone(), k.clone())
    expected = [c.clone() for c in caches]
    write_kv_reference(k_ref, v, *expected, slots)
    assert native.rope_fits(q, k, v, *caches)
    native.rope_write_kv(q, k, v, cos_sin, positions, *caches, slots)
    assert torch.equal(q, q_ref)
    assert _same(caches[0], expected[0]) and _same(caches[1], expected[1])
    flat_v = caches[1].view(-1, *caches[1].shape[2:])
    written = _bits(flat_v[slots[0]]).flatten()[:len(ROUNDING)].int() & 0xFFFF
    assert written.tolist() == list(ROUNDING.values())
    # k: the rotated float32 value, rounded (not the rotation computed in bf16)
    flat_k = caches[0].view(-1, *caches[0].shape[2:])
    assert _same(flat_k[slots[0]], k_ref[0].to(torch.bfloat16))


@pytest.mark.parametrize("cascade", [True, False])
def test_torch_ops_over_bf16_are_float32_over_the_rounded_values(cascade) -> None:
    """The plain-torch table (the native kernels off): its KV write rounds as torch does,
    and its attention (cascade, or the plain reference) over the bf16 caches equals its
    attention over float32 caches holding the rounded values."""
    batch = _mixed_batch()
    args = batch.kernel_args()
    _, block_size, num_kv_heads, head_dim = batch.k_cache.shape
    ops = select_ops(torch.device("cpu"), torch.float32,
                     AttentionShape(args["query"].shape[1], num_kv_heads, head_dim, block_size),
                     native_kernels=False, cascade=cascade)
    assert ops.name == "torch"
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), args["cu_seqlens_q"],
                             args["context_lens"], args["block_tables"],
                             args["max_query_len"], args["max_context_len"])
    ops.plan(meta, torch.zeros(0, dtype=torch.int64))
    k16, v16 = batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)
    out = ops.attention(args["query"], k16, v16, meta, args["scale"])
    assert out.dtype == torch.float32
    assert torch.equal(out, ops.attention(args["query"], k16.float(), v16.float(), meta,
                                          args["scale"]))
    reference = paged_attention_reference(**{**args, "k_cache": k16.float(),
                                             "v_cache": v16.float()})
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=1e-5)
    # the KV write of the torch table
    (q, k, v), cos_sin, positions, slots, caches = _rope_case(16, pad=False)
    expected = [c.clone() for c in caches]
    q_ref, k_ref = apply_rope(cos_sin, positions, q, k)
    for cache, new in zip(expected, (k_ref, v), strict=True):
        cache.view(-1, *cache.shape[2:])[slots] = new.to(torch.bfloat16)
    rotated = ops.rope_write_kv(q, k, v, cos_sin, positions, *caches, slots)
    assert torch.equal(rotated, q_ref)
    assert _same(caches[0], expected[0]) and _same(caches[1], expected[1])
