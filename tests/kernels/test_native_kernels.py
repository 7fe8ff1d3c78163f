"""The native CPU kernels (kernels/cpu/*.c via kernels/cpu/native.py) against plain torch
in float64: the skinny GEMM for every row count and tile remainder, the paged decode
attention for GQA groups, head sizes, block sizes and partial blocks; that the panel linear
layer and the CPU ops table really take them; and the build's cache and its fallbacks."""

from __future__ import annotations

import pytest
import torch
from helpers.kernel_cases import BatchSpec, build_batch, dense_attention, share_prefix
from helpers.products import on_row
from helpers.threads import torch_threads
from torch import nn

from plait.engine.models.linear import Linear, apply_products, resolve_cpu_gemm
from plait.kernels import AttentionMetadata, AttentionShape, select_ops
from plait.kernels.cpu import attention, build, native
from plait.kernels.cpu.attention import native_attention, plan_native
from plait.kernels.cpu.build import NATIVE_MAX_ROWS
from plait.kernels.cpu.products import BLAS, ProductSettings
from plait.kernels.reference import paged_attention_reference

needs_native = pytest.mark.skipif(not build.available(),
                                  reason="no C compiler / not x86-64: native kernels off")


@needs_native
@pytest.mark.parametrize("shape", [(200, 96), (960, 576), (7, 13), (49, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_equals_float64_for_every_row_count(shape, bias) -> None:
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    panels = native.pack_weight(weight)
    assert panels.shape == (-(-out_features // native.lanes()), in_features, native.lanes())
    for rows in (1, 2, 5, 8, 11, 12, 13, 16, 17, 24, 33):
        x = torch.randn(rows, in_features, generator=gen)
        expected = x.double() @ weight.double().t() + (0 if b is None else b.double())
        out = native.gemm(x, panels, out_features, b)
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
        strided = torch.randn(rows, in_features * 2, generator=gen)[:, ::2]  # row stride 2K
        torch.testing.assert_close(
            native.gemm(strided, panels, out_features, b).double(),
            strided.double() @ weight.double().t() + (0 if b is None else b.double()),
            rtol=1e-5, atol=1e-4)
        rowed = torch.randn(rows, in_features + 3, generator=gen)[:, :in_features]
        torch.testing.assert_close(native.gemm(rowed, panels, out_features, b),
                                   native.gemm(rowed.contiguous(), panels, out_features, b),
                                   rtol=0, atol=0)


@needs_native
def test_gemm_rejects_a_mismatched_input() -> None:
    panels = native.pack_weight(torch.randn(32, 16))
    with pytest.raises(ValueError, match="does not fit"):
        native.gemm(torch.randn(4, 17), panels, 32)
    with pytest.raises(ValueError, match="does not fit"):
        native.gemm(torch.randn(4, 16, dtype=torch.float64), panels, 32)
    assert native.gemm(torch.randn(0, 16), panels, 32).shape == (0, 32)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("large", sorted(BLAS))
def test_panel_linear_takes_the_panels_up_to_the_row_limit(bias, large, monkeypatch) -> None:
    """The panels/<blas> rows: the native GEMM for 1..NATIVE_MAX_ROWS rows, their BLAS row
    (any of them) above, a dense output either way; the same weight Parameter as the loaded
    one."""
    if large == "mkl" and not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    torch.manual_seed(0)
    plain = Linear(64, 80, bias=bias)
    nn.init.normal_(plain.weight)
    if bias:
        nn.init.normal_(plain.bias)
    layer = on_row(plain, f"panels/{BLAS[large].name}")
    state = layer.state
    assert state is not None and state.large is not None and state.packed is not None
    assert state.weight is plain.weight and state.large.weight is plain.weight
    assert state.packed.shape == (-(-80 // native.lanes()), 64, native.lanes())
    calls = []
    real = native.gemm
    monkeypatch.setattr(native, "gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 16, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 30, 100):
        x = torch.randn(rows, 64)
        expected = nn.functional.linear(x.double(), plain.weight.double(),
                                        None if plain.bias is None else plain.bias.double())
        out = layer(x)
        assert out.is_contiguous()
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)
    assert calls == [1, 16, NATIVE_MAX_ROWS]


def _reference(query, k_cache, v_cache, table, ctx, scale):
    """One sequence's attention over its tokens [0, ctx), in float64."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ids = table[: -(-ctx // block_size)].long()
    keys = k_cache[ids].flatten(0, 1)[:ctx].double()  # [L, H_kv, D]
    values = v_cache[ids].flatten(0, 1)[:ctx].double()
    group = query.shape[0] // num_kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", query.double(), keys) * scale  # [H, L]
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


def _chunked_case(heads, kv_heads, head_dim, block_size, seed):
    """A shared chunk of 3 rows (5 common blocks, own tails of 1 token to 2 blocks + 3), a
    chunk of 2 rows sharing 1 block, and 3 rows alone (1 token, a partial block, exact
    blocks); tables and query rows in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, width = 96, 12
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: 8 * width].view(8, width).int()
    chunks = [([0, 1, 2], 5), ([3, 4], 1), ([5], 0), ([6], 0), ([7], 0)]
    ctx = [5 * block_size + 1, 6 * block_size + 5, 7 * block_size + 3, block_size + 1,
           2 * block_size, 1, block_size - 1, 3 * block_size]
    for rows, shared in chunks:
        tables[rows, :shared] = tables[rows[0], :shared]
    query = torch.randn(11, heads * head_dim + 8, generator=gen)[:, :heads * head_dim].view(
        -1, heads, head_dim)  # rows strided, heads dense
    table_rows = torch.tensor([7, 0, 2, 1, 4, 3, 6, 5])  # sequence of each query row below
    q_rows = torch.tensor([9, 0, 4, 2, 10, 7, 1, 3])
    order = [s for rows, _ in chunks for s in rows]
    where = {seq: i for i, seq in enumerate(table_rows.tolist())}
    args = dict(
        chunk_start=torch.tensor([0, 3, 5, 6, 7, 8]),
        chunk_shared=torch.tensor([n * block_size for _, n in chunks], dtype=torch.int32),
        q_rows=q_rows[[where[s] for s in order]], table_rows=torch.tensor(order),
        ctx_lens=torch.tensor([ctx[s] for s in order], dtype=torch.int32))
    return query, k_cache, v_cache, tables, args


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 32), (6, 2, 64, 5)])
def test_decode_attention_equals_float64(heads, kv_heads, head_dim, block_size) -> None:
    if head_dim % native.lanes():
        pytest.skip("head_dim not a multiple of this CPU's vector width")
    query, k_cache, v_cache, tables, args = _chunked_case(heads, kv_heads, head_dim,
                                                          block_size, heads + block_size)
    scale = head_dim ** -0.5
    out = native.decode_attention(query, k_cache, v_cache, tables, scale=scale, **args)
    assert out.shape == (8, heads, head_dim)
    for i in range(8):
        seq, ctx = int(args["table_rows"][i]), int(args["ctx_lens"][i])
        ref = _reference(query[args["q_rows"][i]], k_cache, v_cache, tables[seq], ctx, scale)
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=2e-6)


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "rows", "shared_blocks"),
                         [(9, 3, 16, 40), (4, 1, 8, 25), (9, 3, 1, 0), (2, 1, 1, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_few_tasks_long_ranges_equal_float64(heads, kv_heads, rows,
                                                              shared_blocks, threads) -> None:
    """Few chunks x KV heads and a long range (one prompt's n choices sharing 40 or 25
    blocks, or one row alone over 37 blocks), on one thread or two: each row's result
    equals float64 attention over its own table, own tails included (the kernel once split
    such ranges into merged pieces; now one online softmax runs over each, so a row's bits
    do not depend on the step: test_attention_invariance.py)."""
    if 64 % native.lanes():
        pytest.skip("head_dim not a multiple of this CPU's vector width")
    gen = torch.Generator().manual_seed(rows + heads)
    block_size, head_dim = 16, 64
    k_cache = torch.randn(768, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(768, block_size, kv_heads, head_dim, generator=gen)
    ids = torch.randperm(768, generator=gen).int()
    width = max(shared_blocks, 37) + 3
    tables = ids[: rows * width].view(rows, width).clone()
    tables[:, :shared_blocks] = tables[0, :shared_blocks]
    ctx = ([shared_blocks * block_size + 1 + (7 * r) % 40 for r in range(rows)]
           if shared_blocks else [37 * block_size + 5])
    query = torch.randn(rows, heads, head_dim, generator=gen)
    args = dict(chunk_start=torch.tensor([0, rows]),
                chunk_shared=torch.tensor([shared_blocks * block_size], dtype=torch.int32),
                q_rows=torch.arange(rows), table_rows=torch.arange(rows),
                ctx_lens=torch.tensor(ctx, dtype=torch.int32))
    with torch_threads(threads):
        out = native.decode_attention(query, k_cache, v_cache, tables, scale=0.125, **args)
    for r in range(rows):
        ref = _reference(query[r], k_cache, v_cache, tables[r], ctx[r], 0.125)
        torch.testing.assert_close(out[r].double(), ref, rtol=1e-5, atol=2e-6)


def _lone_long_row():
    """One sequence alone over 37 blocks with one KV head: fewer tasks than threads."""
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(64, 16, 1, 64, generator=gen)
    v_cache = torch.randn(64, 16, 1, 64, generator=gen)
    tables = torch.randperm(64, generator=gen)[:40].view(1, 40).int()
    query = torch.randn(3, 4, 64, generator=gen)
    args = dict(chunk_start=torch.tensor([0, 1]), chunk_shared=torch.zeros(1, dtype=torch.int32),
                q_rows=torch.tensor([1]), table_rows=torch.tensor([0]),
                ctx_lens=torch.tensor([37 * 16 + 5], dtype=torch.int32))
    return query, k_cache, v_cache, tables, args


@needs_native
@pytest.mark.parametrize("case", ["chunks", "split"])
def test_decode_attention_writes_each_sequence_to_its_out_row(case) -> None:
    """Chunks of shared and lone rows, or one long row alone: with out_rows, sequence i's
    result is exactly row out_rows[i] of the output."""
    query, k_cache, v_cache, tables, args = (_chunked_case(9, 3, 64, 16, 3) if case == "chunks"
                                             else _lone_long_row())
    chunked = native.decode_attention(query, k_cache, v_cache, tables, scale=0.125, **args)
    rows = len(args["q_rows"])
    out_rows = torch.randperm(query.shape[0], generator=torch.Generator().manual_seed(1))[:rows]
    out = native.decode_attention(query, k_cache, v_cache, tables, scale=0.125,
                                  out_rows=out_rows, **args)
    assert out.shape == query.shape
    assert torch.equal(out[out_rows], chunked)
    with pytest.raises(ValueError, match="out_rows"):
        native.decode_attention(query, k_cache, v_cache, tables, scale=0.125,
                                out_rows=out_rows + query.shape[0], **args)


@needs_native
def test_decode_attention_rejects_what_it_cannot_take() -> None:
    query, k_cache, v_cache, tables, args = _chunked_case(4, 2, 64, 16, 0)
    with pytest.raises(ValueError, match="ctx_lens"):
        native.decode_attention(query, k_cache, v_cache, tables, scale=1.0,
                                **{**args, "ctx_lens": args["ctx_lens"].float()})
    with pytest.raises(ValueError, match=r"\[H, D\] contiguous"):
        native.decode_attention(query.transpose(1, 2).contiguous().transpose(1, 2), k_cache,
                                v_cache, tables, scale=1.0, **args)
    big = native.max_chunk_rows(2) + 1  # one chunk of too many rows
    assert native.max_chunk_rows(2) == native.MAX_QUERIES // 2
    with pytest.raises(ValueError, match="limits"):
        native.decode_attention(
            query.repeat(big, 1, 1), k_cache, v_cache, tables, scale=1.0,
            chunk_start=torch.tensor([0, big]), chunk_shared=torch.zeros(1, dtype=torch.int32),
            q_rows=torch.arange(big), table_rows=torch.zeros(big, dtype=torch.int64),
            ctx_lens=torch.ones(big, dtype=torch.int32))
    assert not native.supports_attention(100, 2, 64, 16)  # 50 query heads per KV head
    assert native.supports_attention(4, 2, 64, 16)


@needs_native
def test_cascade_backend_attends_decodes_natively(fresh_library, monkeypatch) -> None:
    """Every row (decodes with a shared prefix, in chunks, unique contexts, and a prefill
    chunk) goes through the native kernel, once per call, and the result still equals
    plain paged attention and dense attention; the chunks split a shared group evenly."""
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention",
                        lambda *a, **k: calls.append(a[4].tolist()) or real(*a, **k))
    seqs = (*((1, 70 + i) for i in range(20)), (1, 33), (5, 20), (1, 1))
    spec = BatchSpec(seqs=seqs, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
                     seed=3)
    batch = build_batch(spec)
    share_prefix(batch, list(range(20)), 4, 16)
    plain = paged_attention_reference(**batch.kernel_args())
    for min_prefix in (1, 100):  # with a shared prefix, and every row on its own keys
        out = _native(batch, min_prefix)
        torch.testing.assert_close(out, plain, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(out.double(), dense_attention(batch), atol=2e-6, rtol=1e-5)
    # 20 shared rows, at most 48 // 3 = 16 per chunk: 10 + 10; then the 2 other decodes,
    # then the prefill chunk of 5 queries as one tile
    assert native.max_chunk_rows(3) == 16
    assert calls == [[0, 10, 20, 21, 22, 27], [*range(23), 27]]
    assert attention.native_chunks([([0, 1, 2, 3, 4], 2)], 7, 2) == [
        ([0], 2), ([1, 2], 2), ([3, 4], 2), ([5], 0), ([6], 0)]
    # the CPU ops table attends natively, in one call; the torch table (kernels off) does
    # not call the kernel
    for native_kernels, expected_calls in ((True, 3), (False, 3)):
        torch.testing.assert_close(_ops_attention(batch, native_kernels), plain, atol=2e-6,
                                   rtol=1e-5)
        assert len(calls) == expected_calls


@needs_native
@pytest.mark.parametrize("cached", [0, 37])
def test_prefill_chunks_go_native_as_causal_tiles(fresh_library, monkeypatch, cached) -> None:
    """Prefill chunks (from the first token, and after `cached` cached tokens) attend through
    the native kernel as tiles of up to max_chunk_rows consecutive positions, longest first:
    tile [p, p + R) shares the tokens before p, row p + r attends up to p + r. Equal to plain
    paged attention and to dense attention, beside decode rows."""
    assert [(t.start, t.stop) for t in attention.prefill_tiles(range(3, 40), 16)] == [
        (35, 40), (19, 35), (3, 19)]
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention",
                        lambda *a, **k: calls.append((a[4].tolist(), a[5].tolist()))
                        or real(*a, **k))
    spec = BatchSpec(seqs=((40, 40 + cached), (1, 30), (21, 21 + cached), (1, 7)),
                     num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=cached)
    batch = build_batch(spec)
    out = _native(batch)
    torch.testing.assert_close(out, paged_attention_reference(**batch.kernel_args()),
                               atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=2e-6, rtol=1e-5)
    # the 2 decodes alone, then 40 queries as tiles of 8, 16, 16 and 21 as 5, 16
    assert calls == [([0, 1, 2, 10, 26, 42, 47, 63],
                      [0, 0, cached + 32, cached + 16, cached, cached + 16, cached])]


def _native(batch, min_prefix_blocks: int = attention.MIN_PREFIX_BLOCKS) -> torch.Tensor:
    """`batch`'s attention through `plan_native` and `native_attention`."""
    args = batch.kernel_args()
    block_size, num_kv_heads = args["k_cache"].shape[1], args["k_cache"].shape[2]
    rows = plan_native(args["cu_seqlens_q"], args["context_lens"], args["block_tables"],
                       block_size, args["query"].shape[1] // num_kv_heads,
                       args["max_query_len"], args["max_context_len"], min_prefix_blocks)
    return native_attention(args["query"], args["k_cache"], args["v_cache"],
                            args["block_tables"], rows, args["scale"])


def _ops_attention(batch, native_kernels: bool) -> torch.Tensor:
    """`batch`'s attention through the float32 CPU ops table, planned as the runner does."""
    args = batch.kernel_args()
    _, block_size, num_kv_heads, head_dim = args["k_cache"].shape
    ops = select_ops(torch.device("cpu"), torch.float32,
                     AttentionShape(args["query"].shape[1], num_kv_heads, head_dim, block_size),
                     native_kernels=native_kernels)
    assert ops.name == ("cpu-native" if native_kernels and build.available() else "torch")
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), args["cu_seqlens_q"],
                             args["context_lens"], args["block_tables"],
                             args["max_query_len"], args["max_context_len"])
    ops.plan(meta, torch.zeros(0, dtype=torch.int64))
    return ops.attention(args["query"], args["k_cache"], args["v_cache"], meta, args["scale"])


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """`build.library()` rebuilt from scratch into an empty cache, restored afterwards."""
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path))
    build.library.cache_clear()
    native.supports_attention.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    build.library.cache_clear()
    native.supports_attention.cache_clear()


@needs_native
def test_the_build_is_cached_per_machine(fresh_library) -> None:
    lib = build.library()
    assert lib is not None and lib.plait_lanes() in (4, 8, 16)
    built = list((fresh_library / "native").glob("plait_cpu_ops-*.so"))
    assert len(built) == 1 and not list((fresh_library / "native").glob("*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    build.library.cache_clear()
    assert build.library() is not None  # a second process: loads, does not rebuild
    assert built[0].stat().st_mtime_ns == stamp


def test_without_the_kernels_everything_falls_back(fresh_library, monkeypatch,
                                                    caplog) -> None:
    """No C compiler: the build is refused (logged), the engine's ops table is the torch
    one, linear layers keep a BLAS format, and attention still equals the reference."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level("WARNING", logger="plait.kernels"):
        assert build.library() is None and not build.available()
    assert "native CPU kernels off" in caplog.text
    assert not native.supports_attention(4, 2, 64, 16)
    with pytest.raises(RuntimeError, match="not available"):
        native.pack_weight(torch.zeros(4, 4))
    model = nn.Sequential(Linear(16, 24))
    nn.init.normal_(model[0].weight)
    nn.init.normal_(model[0].bias)
    apply_products(model, ProductSettings(resolve_cpu_gemm()))
    assert model[0].product is BLAS[resolve_cpu_gemm()]
    x = torch.randn(3, 16)
    torch.testing.assert_close(model(x), nn.functional.linear(x, model[0].weight,
                                                              model[0].bias))
    spec = BatchSpec(seqs=((1, 40), (1, 9)), num_heads=4, num_kv_heads=2, head_dim=32,
                     block_size=8, seed=1)
    batch = build_batch(spec)
    torch.testing.assert_close(_ops_attention(batch, native_kernels=True),
                               paged_attention_reference(**batch.kernel_args()), atol=2e-6,
                               rtol=1e-5)


@needs_native
@pytest.mark.parametrize("num_tokens", [1, 16, 100])
def test_rope_write_kv_is_the_torch_path_bit_for_bit(num_tokens) -> None:
    """The fused rotary embedding + KV write equals `apply_rope` then `write_kv_reference`
    exactly (torch.equal): q rotated in place in its strided qkv buffer, the rotated k and v
    at their slots, a slot of -1 not written, the other cache rows untouched."""
    from plait.engine.models.rope import rope_cos_sin
    from plait.kernels.ops import apply_rope
    from plait.kernels.reference import write_kv_reference

    gen = torch.Generator().manual_seed(num_tokens)
    heads, kv_heads, head_dim = 9, 3, 64
    cos_sin = rope_cos_sin(head_dim, 4096, 10000.0, None)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    slots = torch.randperm(40 * 16, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1

    def split(t):
        q, k, v = t.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
        return (q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
                v.view(num_tokens, kv_heads, head_dim))

    caches = [torch.randn(40, 16, kv_heads, head_dim, generator=gen) for _ in range(2)]
    expected = [c.clone() for c in caches]
    q, k, v = split(qkv.clone())
    q_ref, k_ref = apply_rope(cos_sin, positions, q, k)
    write_kv_reference(k_ref, v, *expected, slots)
    q, k, v = split(qkv.clone())
    assert native.rope_fits(q, k, v, *caches)
    out = native.rope_write_kv(q, k, v, cos_sin, positions, *caches, slots)
    assert out.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    assert not native.rope_fits(q.double(), k, v, *caches)


@needs_native
def test_sample_inverse_cdf_picks_as_the_torch_rule() -> None:
    """The native inverse-CDF sampler picks the token `sampler._inverse_cdf` picks: on
    random rows at many u (away from interval edges, where float rounding may differ), and
    exactly on the edge cases: masked (-inf) tokens never, +inf logits share the mass, a
    row of all -inf is uniform, u near 1 past the last positive weight, a NaN row."""
    from plait.engine.sampler import _inverse_cdf

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=gen) * 3
    logits[3, 500:] = float("-inf")
    u = torch.rand(16, 1, generator=gen)
    assert torch.equal(native.sample_inverse_cdf(logits, u), _inverse_cdf(logits, u))
    for k in range(200):  # one row, u swept
        u1 = torch.tensor([[k / 200 + 0.0013]])
        assert native.sample_inverse_cdf(logits[:1], u1).item() == _inverse_cdf(
            logits[:1], u1).item()
    inf, nan = float("inf"), float("nan")
    cases = torch.tensor([[0.0, -inf, 1.0, -inf, 0.5, -inf, -inf, -inf, -inf, -inf, -inf,
                           -inf, -inf, -inf, -inf, -inf, -inf, -inf],
                          [1.0, inf, 0.3, inf] + [0.0] * 14,
                          [-inf] * 18,
                          [0.2, nan] + [0.0] * 16])
    for value in (0.0, 0.3, 0.6, 0.99999994):
        uu = torch.full((4, 1), value)
        assert torch.equal(native.sample_inverse_cdf(cases, uu), _inverse_cdf(cases, uu))
    picked = native.sample_inverse_cdf(cases[:1].expand(64, -1), torch.rand(64, generator=gen))
    assert set(picked.tolist()) <= {0, 2, 4}


@needs_native
@pytest.mark.parametrize("num_tokens", [1, 16, 100])
def test_add_rms_norm_and_silu_mul_equal_torch(num_tokens) -> None:
    """The fused residual add + RMS norm and SiLU * up equal their float64 torch
    definitions on strided rows (a view of a wider buffer); without `add` the first result
    is x itself."""
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 576 + 7, generator=gen)[:, :576]
    add = torch.randn(num_tokens, 600, generator=gen)[:, 10:586]
    weight = torch.rand(576, generator=gen) + 0.5
    total, out = native.add_rms_norm(x, add, weight, 1e-5)
    s = x.double() + add.double()
    assert torch.equal(total, x + add)  # the same float add
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    same, out = native.add_rms_norm(x, None, weight, 1e-5)
    assert same is x
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double(), ref * weight.double(), rtol=2e-6, atol=2e-6)
    gate_up = torch.randn(num_tokens, 2 * 1536 + 5, generator=gen)[:, :2 * 1536] * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up).double(),
                               torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=2e-6)
    assert not native.rows_fit(x.double())
