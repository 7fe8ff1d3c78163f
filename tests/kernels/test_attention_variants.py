"""Attention variants in every CPU attention path: a sliding window, a logit softcap, both,
and a scale other than D^-0.5, against float64 dense attention with explicit masks
(`kernel_cases.dense_attention`), over decodes, prefills, a mixed batch with cached
prefixes, and n sequences sharing a prompt longer than the window (the cascade / shared
prefix path). Paths: the plain reference, the torch cascade, and the ops tables as the
runner calls them (plan once, attend with the layer's variant). Partial rotary against an
explicit float64 rotation; the NoPE KV write (`ops.write_kv`).

    window 7, block 4, prompt of 8 shared blocks (32 tokens), rows at positions 33..44:
    row at 36 attends 30..36 (2 prompt tokens masked per row, prompt read once)
    row at 44 attends 38..44 (none of the prompt: an empty prefix, merged with weight 0)
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernel_cases import (
    MIXED_SEQS,
    BatchSpec,
    PagedBatch,
    build_batch,
    dense_attention,
    share_prefix,
)
from helpers.threads import torch_threads

from plait.kernels import AttentionMetadata, AttentionShape, CpuNativeOps, TorchOps, select_ops
from plait.kernels.cpu import build, native
from plait.kernels.cpu.attention import (
    cascade_attention_reference,
    native_attention,
    plan_cascade,
    plan_native,
)
from plait.kernels.ops import apply_rope
from plait.kernels.reference import paged_attention_reference, write_kv_reference

BF16 = torch.bfloat16

# (atol, rtol) of float32 paths against float64 (the native kernel's exp and normaliser take
# a multiply and an add where the compiler once fused them: attention.c is built without
# FP contraction, so every copy of its loops rounds alike; ~1e-6 more at worst)
ATOL, RTOL = 4e-6, 1e-5

# name -> (window, softcap, scale or None for D^-0.5)
VARIANTS: dict[str, tuple[int, float, float | None]] = {
    "window": (7, 0.0, None),
    "softcap": (0, 1.5, None),
    "both": (7, 1.5, None),
    "scale": (0, 0.0, 0.37),
    "all": (11, 2.0, 0.25),
}

# name -> (sequences (num_q, ctx), rows sharing a prefix, shared blocks); block size 4
BATCHES: dict[str, tuple[tuple[tuple[int, int], ...], list[int], int]] = {
    "decode": (((1, 1), (1, 37), (1, 64), (1, 20), (1, 7), (1, 8)), [], 0),
    "prefill": (((20, 20), (33, 33), (1, 1)), [], 0),
    "mixed": (MIXED_SEQS, [], 0),
    # 5 rows share a 32-token prompt; their windows start inside it, at its end, or past it
    "shared_prefix": (((1, 37), (1, 33), (1, 40), (1, 45), (1, 34), (3, 12)),
                      [0, 1, 2, 3, 4], 8),
}


def _batch(batch_name: str, variant: str, dtype: torch.dtype = torch.float32,
           head_dim: int = 32) -> tuple[PagedBatch, int, float]:
    """The batch (prefix shared, scale set) and the variant's window and softcap."""
    seqs, rows, shared = BATCHES[batch_name]
    batch = build_batch(BatchSpec(seqs, num_heads=6, num_kv_heads=2, head_dim=head_dim,
                                  block_size=4, dtype=dtype, seed=len(seqs) + len(variant)))
    if rows:
        share_prefix(batch, rows, shared, 4)
    window, softcap, scale = VARIANTS[variant]
    if scale is not None:
        batch.scale = scale
    return batch, window, softcap


def _dense(batch: PagedBatch, window: int, softcap: float) -> torch.Tensor:
    """The float64 truth; also checks that the variant changes it (a path ignoring the
    window or the cap could not pass)."""
    expected = dense_attention(batch, window=window, softcap=softcap)
    if window or softcap:
        plain = dense_attention(batch)
        assert (expected - plain).abs().max() > 1e-2
    return expected


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_reference_and_cascade_match_dense(batch_name, variant):
    batch, window, softcap = _batch(batch_name, variant)
    expected = _dense(batch, window, softcap)
    ref = paged_attention_reference(**batch.kernel_args(), window=window, softcap=softcap)
    torch.testing.assert_close(ref.double(), expected, atol=ATOL, rtol=RTOL)
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    plan = plan_cascade(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                        block_size, 6 // num_kv_heads, batch.max_query_len,
                        batch.max_context_len, min_prefix_blocks=1)
    if batch_name == "shared_prefix":
        assert [p.num_rows for p in plan.prefixes] == [5]
    cascaded = cascade_attention_reference(**batch.kernel_args(), plan=plan, window=window,
                                           softcap=softcap)
    torch.testing.assert_close(cascaded.double(), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("batch_name", ["mixed", "shared_prefix"])
def test_one_plan_serves_every_variant_through_the_torch_ops(batch_name, cascade):
    """The runner plans a step once and its layers attend with their own window and cap
    (Gemma: sliding and global layers alternate): each call equals the dense truth."""
    batch, _, _ = _batch(batch_name, "all")
    meta = _planned(TorchOps(_shape(batch), cascade=cascade), batch)
    ops = TorchOps(_shape(batch), cascade=cascade)
    for window, softcap in ((0, 0.0), (7, 0.0), (0, 1.5), (11, 2.0), (1, 0.0)):
        out = ops.attention(batch.query, batch.k_cache, batch.v_cache, meta, batch.scale,
                            window=window, softcap=softcap)
        torch.testing.assert_close(out.double(), _dense(batch, window, softcap), atol=ATOL,
                                   rtol=RTOL)


def test_defaults_are_the_plain_paths_bit_for_bit():
    """window=0, softcap=0.0 (and a window no context reaches) give exactly the results of
    the calls without them."""
    batch, _, _ = _batch("shared_prefix", "scale")
    args = batch.kernel_args()
    plain = paged_attention_reference(**args)
    assert torch.equal(paged_attention_reference(**args, window=0, softcap=0.0), plain)
    cascaded = cascade_attention_reference(**args, min_prefix_blocks=1)
    assert torch.equal(cascade_attention_reference(**args, min_prefix_blocks=1, window=0,
                                                   softcap=0.0), cascaded)
    wide = paged_attention_reference(**args, window=batch.max_context_len)
    assert torch.equal(wide, plain)


def test_window_of_one_attends_the_query_token_alone():
    """window 1: each query's output is its own value row (softmax over one key)."""
    batch, _, _ = _batch("mixed", "window")
    out = paged_attention_reference(**batch.kernel_args(), window=1)
    starts = batch.cu_seqlens_q.tolist()
    for s, values in enumerate(batch.values):
        n = starts[s + 1] - starts[s]
        own = values[-n:].repeat_interleave(3, dim=1)  # [n, H, D]: 3 query heads per KV head
        torch.testing.assert_close(out[starts[s]:starts[s + 1]], own, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_variants(dtype):
    batch, window, softcap = _batch("shared_prefix", "both", dtype=dtype)
    expected = _dense(batch, window, softcap)
    for path in (paged_attention_reference, cascade_attention_reference):
        out = path(**batch.kernel_args(), window=window, softcap=softcap)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_negative_variants_are_refused():
    batch, _, _ = _batch("decode", "scale")
    for bad in (dict(window=-1), dict(softcap=-1.0), dict(softcap=float("nan"))):
        with pytest.raises(ValueError, match="window must be"):
            paged_attention_reference(**batch.kernel_args(), **bad)
        with pytest.raises(ValueError, match="window must be"):
            cascade_attention_reference(**batch.kernel_args(), **bad)


# ---------------------------------------------------------------------------- rotary
def _explicit_rope(x: torch.Tensor, positions: torch.Tensor, rot: int,
                   theta: float) -> torch.Tensor:  # [T, H, D] float64
    """Neox RoPE of the first `rot` dims of each head in float64, written out pair by pair:
    (x_i, x_{i + rot/2}) rotated by angle pos * theta^(-2i / rot); dims rot.. unchanged."""
    out = x.double().clone()
    half = rot // 2
    for i in range(half):
        angle = positions.double() * theta ** (-2 * i / rot)  # [T]
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        a, b = x[..., i].double(), x[..., i + half].double()
        out[..., i] = a * cos - b * sin
        out[..., i + half] = b * cos + a * sin
    return out


@pytest.mark.parametrize("rot", [96, 128, 32])
def test_partial_rotary_against_explicit_rotation(rot):
    """A cos | sin table of width R < D rotates the first R dims of each head (pairs
    (i, i + R/2)) and passes the rest through bit for bit; R == D is the whole head."""
    from plait.engine.models.rope import rope_cos_sin

    gen = torch.Generator().manual_seed(rot)
    q = torch.randn(9, 4, 128, generator=gen)
    k = torch.randn(9, 2, 128, generator=gen)
    positions = torch.tensor([0, 1, 5, 17, 100, 511, 2047, 3, 3])
    cos_sin = rope_cos_sin(rot, 2048, 10000.0, None)  # [P, R]
    q_rot, k_rot = apply_rope(cos_sin, positions, q, k)
    for x, got in ((q, q_rot), (k, k_rot)):
        torch.testing.assert_close(got.double(), _explicit_rope(x, positions, rot, 10000.0),
                                   atol=2e-5, rtol=1e-5)
        assert torch.equal(got[..., rot:], x[..., rot:])
    assert not torch.allclose(q_rot[..., :rot], q[..., :rot])


def test_rope_tables_of_a_bad_width_are_refused():
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    for width in (66, 30 + 1, 0):
        with pytest.raises(ValueError, match="RoPE table"):
            apply_rope(torch.randn(8, width), torch.tensor([0, 1]), q, k)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_rope_write_kv_with_partial_rotary(cache_dtype):
    """`TorchOps.rope_write_kv` with a table of width 96 for D = 128 (Phi-3): q returned
    rotated as `_explicit_rope`, the rotated k and the plain v at their slots."""
    from plait.engine.models.rope import rope_cos_sin

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, h, 128, generator=gen) for h in (4, 2, 2))
    positions = torch.tensor([7, 8, 9, 30, 31])
    slots = torch.tensor([3, 17, 4, 40, 9])
    caches = [torch.zeros(12, 4, 2, 128, dtype=cache_dtype) for _ in range(2)]
    ops = TorchOps(AttentionShape(4, 2, 128, 4))
    cos_sin = rope_cos_sin(96, 64, 10000.0, None)
    q_out = ops.rope_write_kv(q, k, v, cos_sin, positions, *caches, slots)
    torch.testing.assert_close(q_out.double(), _explicit_rope(q, positions, 96, 10000.0),
                               atol=2e-5, rtol=1e-5)
    written_k = caches[0].view(-1, 2, 128)[slots]
    torch.testing.assert_close(written_k.double(), _explicit_rope(k, positions, 96, 10000.0),
                               atol=2e-2 if cache_dtype == torch.bfloat16 else 2e-5,
                               rtol=1e-2 if cache_dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(caches[1].view(-1, 2, 128)[slots], v.to(cache_dtype))


# ---------------------------------------------------------------------------- NoPE
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_nope_write_kv_then_attention(cache_dtype):
    """A NoPE layer: `ops.write_kv` of unrotated k, v (views of a fused qkv row) into the
    cache, then attention with unrotated q: the cache holds exactly k, v (cast), and the
    attention equals dense attention over them."""
    batch = build_batch(BatchSpec(((1, 9), (4, 4)), num_heads=4, num_kv_heads=2,
                                  head_dim=32, block_size=4, seed=5))
    _nope_case(TorchOps(_shape(batch)), batch, cache_dtype)


def _nope_case(ops: TorchOps, batch: PagedBatch, cache_dtype: torch.dtype) -> None:
    """Write each query token's new K/V (the batch's last dense rows, replaced by fresh
    values) through `ops.write_kv`, attend, and compare with dense attention."""
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    starts, ctx = batch.cu_seqlens_q.tolist(), batch.context_lens.tolist()
    slots, new_k, new_v = [], [], []
    for s in range(len(ctx)):
        n = starts[s + 1] - starts[s]
        fused = torch.randn(n, 3, 2, 32, generator=gen)  # q-ish | k | v of a fused row
        fused = fused.to(cache_dtype).float()  # exact in the cache
        new_k.append(fused[:, 1])
        new_v.append(fused[:, 2])
        batch.keys[s] = torch.cat([batch.keys[s][:ctx[s] - n].to(cache_dtype).float(),
                                   fused[:, 1]])
        batch.values[s] = torch.cat([batch.values[s][:ctx[s] - n].to(cache_dtype).float(),
                                     fused[:, 2]])
        for p in range(ctx[s] - n, ctx[s]):
            slots.append(int(batch.block_tables[s, p // 4]) * 4 + p % 4)
    slot_mapping = torch.tensor(slots)
    ops.write_kv(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.view(-1, 2, 32)[slot_mapping].float(), torch.cat(new_k))
    assert torch.equal(v_cache.view(-1, 2, 32)[slot_mapping].float(), torch.cat(new_v))
    meta = _planned(ops, batch)
    out = ops.attention(batch.query, k_cache, v_cache, meta, batch.scale, window=3)
    torch.testing.assert_close(out.double(), dense_attention(batch, window=3), atol=ATOL,
                               rtol=RTOL)


def _shape(batch: PagedBatch) -> AttentionShape:
    _, block_size, num_kv_heads, head_dim = batch.k_cache.shape
    return AttentionShape(batch.query.shape[1], num_kv_heads, head_dim, block_size)


def _planned(ops: TorchOps, batch: PagedBatch) -> AttentionMetadata:
    """The batch's metadata planned by `ops`, as the runner plans a step."""
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), batch.cu_seqlens_q,
                             batch.context_lens, batch.block_tables, batch.max_query_len,
                             batch.max_context_len)
    return ops.plan(meta, torch.zeros(0, dtype=torch.int64))


# ---------------------------------------------------------------------------- native
needs_native = pytest.mark.skipif(not build.available(),
                                  reason="no C compiler / not x86-64: native kernels off")


def _native(batch: PagedBatch, window: int, softcap: float,
            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`batch` through `plan_native` (every shared run of a block or more cascaded) and
    `native_attention` with the variant."""
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    rows = plan_native(batch.cu_seqlens_q, batch.context_lens, batch.block_tables, block_size,
                       batch.query.shape[1] // num_kv_heads, batch.max_query_len,
                       batch.max_context_len, min_prefix_blocks=1)
    return native_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                            rows, batch.scale, compute_dtype, window=window, softcap=softcap)


def _to_bf16_cache(batch: PagedBatch) -> None:
    """The batch's caches (and its dense K/V, the truth) in bfloat16, in place."""
    batch.k_cache, batch.v_cache = batch.k_cache.to(BF16), batch.v_cache.to(BF16)
    batch.keys = [k.to(BF16).float() for k in batch.keys]
    batch.values = [v.to(BF16).float() for v in batch.values]


@needs_native
@pytest.mark.parametrize("cache", ["f32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_native_matches_dense(batch_name, variant, cache):
    """The native kernel (decode chunks, prefill tiles, the shared prefix read once) with
    each variant, over float32 and bfloat16 caches (float32 compute: bf16 values widened)."""
    batch, window, softcap = _batch(batch_name, variant, head_dim=64)
    if cache == "bf16":
        _to_bf16_cache(batch)
    out = _native(batch, window, softcap)
    torch.testing.assert_close(out.double(), _dense(batch, window, softcap), atol=ATOL,
                               rtol=RTOL)


@needs_native
@pytest.mark.parametrize("variant", ["window", "softcap", "both", "all"])
@pytest.mark.parametrize("batch_name", ["prefill", "shared_prefix"])
def test_native_bf16_dot_products_with_variants(batch_name, variant):
    """compute_dtype bfloat16 over a bf16 cache: every token (prefill tiles, the shared
    prompt, the rows' own) through bf16 dot products, masked and capped as the float32
    path: within bf16 rounding of the truth (queries and weights rounded: 2^-8 relative),
    far closer to it than to the result without the variant."""
    batch, window, softcap = _batch(batch_name, variant, head_dim=64)
    _to_bf16_cache(batch)
    expected = _dense(batch, window, softcap)
    out = _native(batch, window, softcap, compute_dtype=BF16).double()
    error = (out - expected).abs()
    effect = (dense_attention(batch) - expected).abs()
    assert error.max() < 2e-2 and error.mean() < 2e-3
    assert effect.mean() > 10 * error.mean()


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [1, 50, 300, 700])
def test_native_long_ranges_with_a_window(window, threads):
    """Few chunks x KV heads and long ranges, each attended from the slice grid point at or
    below its rows' lowest window start: 6 rows sharing 40 blocks (the window cuts into the
    prompt, or past it), and a lone row of 37 blocks."""
    spec = BatchSpec(seqs=(*((1, 640 + 1 + 9 * r) for r in range(6)), (1, 37 * 16 + 5)),
                     num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, seed=window)
    batch = build_batch(spec)
    share_prefix(batch, list(range(6)), 40, 16)
    with torch_threads(threads):
        out = _native(batch, window, 0.0)
    torch.testing.assert_close(out.double(), dense_attention(batch, window=window), atol=ATOL,
                               rtol=RTOL)


@needs_native
def test_native_defaults_and_a_window_past_every_context_are_the_plain_kernel():
    """window=0, softcap=0.0 and a window no row's context reaches: bit for bit the
    kernel's result without them (no base, no mask)."""
    batch, _, _ = _batch("shared_prefix", "scale", head_dim=64)
    plain = _native(batch, 0, 0.0)
    assert torch.equal(_native(batch, batch.max_context_len, 0.0), plain)
    with pytest.raises(ValueError, match="window must be"):
        _native(batch, -1, 0.0)
    with pytest.raises(ValueError, match="window must be"):
        _native(batch, 0, -2.0)


@needs_native
@pytest.mark.parametrize("batch_name", ["mixed", "shared_prefix"])
def test_one_plan_serves_every_variant_through_the_native_ops(batch_name):
    """`CpuNativeOps` (what a float32 CPU engine gets), planned once, attending with a
    different window and cap per call, each equal to the dense truth."""
    batch, _, _ = _batch(batch_name, "all", head_dim=64)
    ops = select_ops(torch.device("cpu"), torch.float32, _shape(batch))
    assert isinstance(ops, CpuNativeOps) and ops.native_attention
    meta = _planned(ops, batch)
    for window, softcap in ((0, 0.0), (7, 0.0), (0, 1.5), (11, 2.0), (1, 0.0)):
        out = ops.attention(batch.query, batch.k_cache, batch.v_cache, meta, batch.scale,
                            window=window, softcap=softcap)
        torch.testing.assert_close(out.double(), _dense(batch, window, softcap), atol=ATOL,
                                   rtol=RTOL)


@needs_native
@pytest.mark.parametrize("rot", [72, 96, 128])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
def test_native_partial_rotary_is_the_torch_path_bit_for_bit(rot, cache_dtype, offset):
    """`native.rope_write_kv` with a table of width R (96 of 128: Phi-3; 72: 36 pairs a
    head, the last 4 past two 16-lane vectors in the scalar tail) equals
    `apply_rope` then `write_kv_reference` exactly: q in place in its strided qkv buffer,
    the rotated k (less the key offset, where given: every dim, rotated or not) and v at
    their slots, a slot of -1 not written; `TorchOps.rope_write_kv` writes the same."""
    from plait.engine.models.rope import rope_cos_sin

    gen = torch.Generator().manual_seed(rot)
    heads, kv_heads, head_dim, tokens = 4, 2, 128, 19
    cos_sin = rope_cos_sin(rot, 512, 10000.0, None)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    slots = torch.randperm(10 * 8, generator=gen)[:tokens]
    slots[5] = -1

    def split(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = t.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
        return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
                v.view(tokens, kv_heads, head_dim))

    caches = [torch.randn(10, 8, kv_heads, head_dim, generator=gen).to(cache_dtype)
              for _ in range(2)]
    k_offset = 30 * torch.randn(kv_heads, head_dim, generator=gen) if offset else None
    expected = [c.clone() for c in caches]
    q, k, v = split(qkv.clone())
    q_ref, k_ref = apply_rope(cos_sin, positions, q, k)
    write_kv_reference(k_ref if k_offset is None else k_ref - k_offset, v, *expected, slots)
    torch_caches, valid = [c.clone() for c in caches], slots >= 0  # (it takes no -1 slot)
    shape = AttentionShape(heads, kv_heads, head_dim, 8)
    q_torch = TorchOps(shape).rope_write_kv(
        *(t[valid] for t in split(qkv.clone())), cos_sin, positions[valid], *torch_caches,
        slots[valid], k_offset)
    assert torch.equal(q_torch, q_ref[valid])
    assert all(torch.equal(a, b) for a, b in zip(torch_caches, expected, strict=True))
    q, k, v = split(qkv.clone())
    out = native.rope_write_kv(q, k, v, cos_sin, positions, *caches, slots, k_offset)
    assert out.data_ptr() == q.data_ptr()
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    if k_offset is not None:
        with pytest.raises(ValueError, match="key offset"):
            native.rope_write_kv(q, k, v, cos_sin, positions, *caches, slots, k_offset[:1])
    torch.testing.assert_close(q.double(), _explicit_rope(split(qkv)[0], positions, rot,
                                                           10000.0), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="RoPE table"):
        native.rope_write_kv(q, k, v, cos_sin[:, :rot - 1], positions, *caches, slots)


@needs_native
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_native_ops_nope_write_kv_then_attention(cache_dtype):
    batch = build_batch(BatchSpec(((1, 9), (4, 4)), num_heads=4, num_kv_heads=2,
                                  head_dim=32, block_size=4, seed=5))
    ops = select_ops(torch.device("cpu"), torch.float32, _shape(batch))
    assert isinstance(ops, CpuNativeOps)
    _nope_case(ops, batch, cache_dtype)


@pytest.mark.parametrize("path", ["reference", "cascade", "native"])
@pytest.mark.parametrize("batch_name", ["decode", "prefill", "shared_prefix"])
def test_gemma2_softcap_of_50_on_large_logits(batch_name, path):
    """Gemma 2's softcap 50 where it bites: queries scaled 10x (logits up to ~40, so the cap
    moves outputs by ~0.2). Float32 logits of that size carry ~4e-6 rounding each, so the
    tolerance is 2e-5 absolute (the float32 torch reference needs it as much as the
    kernels)."""
    if path == "native" and not build.available():
        pytest.skip("no C compiler / not x86-64: native kernels off")
    batch, _, _ = _batch(batch_name, "scale", head_dim=64)
    batch.query *= 10
    expected = dense_attention(batch, softcap=50.0)
    assert (dense_attention(batch) - expected).abs().max() > 0.1
    if path == "native":
        out = _native(batch, 0, 50.0)
    elif path == "cascade":
        out = cascade_attention_reference(**batch.kernel_args(), min_prefix_blocks=1,
                                          softcap=50.0)
    else:
        out = paged_attention_reference(**batch.kernel_args(), softcap=50.0)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=RTOL)


@pytest.mark.parametrize("table", ["torch", "native"])
def test_each_layer_rotates_with_its_own_table(table):
    """Per-layer RoPE: one ops table, calls with tables of other thetas and widths (a
    sliding layer's 10k, a global layer's 1M, Phi-3's partial 96): each call rotates by the
    table it is given (nothing of an earlier call's table is kept)."""
    from plait.engine.models.rope import rope_cos_sin

    if table == "native" and not build.available():
        pytest.skip("no C compiler / not x86-64: native kernels off")
    shape = AttentionShape(4, 2, 128, 4)
    ops = TorchOps(shape) if table == "torch" else select_ops(torch.device("cpu"),
                                                              torch.float32, shape)
    gen = torch.Generator().manual_seed(7)
    positions = torch.tensor([3, 40, 41, 200])
    for theta, rot in ((10000.0, 128), (1e6, 128), (10000.0, 96), (1e6, 128)):
        q, k, v = (torch.randn(4, h, 128, generator=gen) for h in (4, 2, 2))
        caches = [torch.zeros(64, 4, 2, 128) for _ in range(2)]
        slots = torch.tensor([1, 7, 30, 200])
        q_out = ops.rope_write_kv(q.clone(), k, v, rope_cos_sin(rot, 256, theta, None),
                                  positions, *caches, slots)
        torch.testing.assert_close(q_out.double(), _explicit_rope(q, positions, rot, theta),
                                   atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(caches[0].view(-1, 2, 128)[slots].double(),
                                   _explicit_rope(k, positions, rot, theta), atol=2e-5,
                                   rtol=1e-5)
