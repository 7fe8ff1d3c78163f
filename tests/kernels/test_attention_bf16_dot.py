"""bf16 dot products in the native attention (kernels/cpu/attention_bf16.h): over a bf16 KV
cache with compute_dtype bfloat16 (kv_dtype PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT), every token
a row attends (the tokens its chunk shares and its own ones alike, so that a row's result
does not depend on where its chunk's shared prefix ends: test_attention_invariance.py) is
attended with vdpbf16ps: the scaled queries rounded once to bf16 (nearest even), each
softmax weight p rounded to bf16 (nearest even) and summed as rounded into the normaliser;
in a build without AVX512-BF16, every token computes in float32.

The tolerance against float64: the reference takes the kernel's bf16 K/V and its rounded
queries, so what is left is the rounding of p. With p~_t = p_t (1 + d_t), |d_t| <= u = 2^-8
(bf16's 8 significant bits, nearest), and weights w = p / sum p, the output sum p~ v / sum
p~ is off by sum_t w_t d_t (v_t - out) / (1 + sum_t w_t d_t), at most u / (1 - u) sum_t w_t
|v_t - out| per element, plus float32 rounding (1e-5)."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from helpers.kernel_cases import PagedBatch, bf16_batch, bf16_reference
from helpers.native_builds import library_without_avx512bf16
from helpers.threads import torch_threads

from plait.kernels.cpu import build, native, native_attn
from plait.kernels.cpu.attention import NativeRows, native_attention, plan_native

HAS_DOT = build.available() and "avx512_bf16" in build._cpu_flags()
needs_native = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="no AVX512-BF16: the flag computes float32")
BF16 = torch.bfloat16




def _plan(batch: PagedBatch) -> NativeRows:
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    return plan_native(batch.cu_seqlens_q, batch.context_lens, batch.block_tables, block_size,
                       batch.query.shape[1] // num_kv_heads, batch.max_query_len,
                       batch.max_context_len)


def _attend(batch: PagedBatch, rows: NativeRows, compute_dtype: torch.dtype,
            query: torch.Tensor | None = None) -> torch.Tensor:
    return native_attention(batch.query if query is None else query, batch.k_cache,
                            batch.v_cache, batch.block_tables, rows, batch.scale,
                            compute_dtype)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(3, 64, 16), (7, 64, 16), (3, 128, 16), (7, 128, 16), (3, 64, 32),
                          (3, 80, 16)])
def test_bf16_dot_is_within_the_rounding_of_p(group, head_dim, block_size, threads) -> None:
    """Every row within the bound of p's rounding of float64 attention (module docstring),
    the rows of shared chunks, of prefill tiles and alone alike; each measurably not the
    float32 kernel's (the flag took the bf16 path for all of them)."""
    batch = bf16_batch(group, head_dim, block_size)
    rows = _plan(batch)
    with torch_threads(threads):
        out = _attend(batch, rows, BF16)
        f32 = _attend(batch, rows, torch.float32)
    if not HAS_DOT:
        assert torch.equal(out, f32)
        return
    expected, bound = bf16_reference(batch)
    excess = (out.double() - expected).abs() - bound
    assert excess.max().item() <= 1e-5
    differs = (out - f32).abs().amax((1, 2)) > 1e-6  # [T]
    first = int(batch.cu_seqlens_q[-2])  # (30, 30)'s position 0: one token, its V either way
    assert not differs[first] and differs[:first].all() and differs[first + 1:].all()


@needs_dot
@pytest.mark.parametrize("group", [3, 7])
def test_queries_are_rounded_once_to_nearest_even(group) -> None:
    """The output depends on the query only through its scaled value rounded to bf16: a
    query already rounded to nearest even gives the same bits (scale 1/8: rounding commutes
    with it); truncation would not."""
    batch = bf16_batch(group, 64, 16, seed=3)
    decode_rows = list(range(14))  # the rows sharing a prefix, one query each
    query = batch.query[decode_rows]  # [14, H, D]
    rounded = (query * batch.scale).to(BF16).float() / batch.scale
    assert not torch.equal(rounded, query)
    sub = PagedBatch(query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q[:15],
                     batch.context_lens[:14], batch.block_tables[:14], [], [], batch.scale,
                     1, int(batch.context_lens[:14].max()))
    sub_rows = _plan(sub)
    out = _attend(sub, sub_rows, BF16)
    assert torch.equal(out, _attend(sub, sub_rows, BF16, rounded.contiguous()))
    assert not torch.equal(out, _attend(sub, sub_rows, torch.float32))


@needs_dot
@pytest.mark.parametrize("group", [3, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_weights_are_rounded_to_nearest_even_and_summed_rounded(group, threads) -> None:
    """Scores of exactly 0 (token A: K = 0, V = 0) or -1.25 (token B: K = -1.25 e_0, V = 1),
    queries 1 / scale e_0, every block starting with an A (the running max is 0 from the
    first block on): every B token weighs p~ = bf16(e^-1.25) = 147 / 512 (nearest; 146 / 512
    truncated), shared or own, an A 1, and each row's output is (B weight) / (A + B weight)
    in every element, as rounded weights summed into the normaliser give it."""
    batch = bf16_batch(group, 64, 16, seed=5)
    rows = _plan(batch)
    _, block_size, kv_heads, head_dim = batch.k_cache.shape
    is_b = [[t % 3 == 1 for t in range(int(ctx))] for ctx in batch.context_lens]
    for s, marks in enumerate(is_b):
        table = batch.block_tables[s].long()
        for t, b in enumerate(marks):
            slot = table[t // block_size] * block_size + t % block_size
            batch.k_cache.view(-1, kv_heads, head_dim)[slot] = 0
            batch.k_cache.view(-1, kv_heads, head_dim)[slot, :, 0] = -1.25 if b else 0.0
            batch.v_cache.view(-1, kv_heads, head_dim)[slot] = 1.0 if b else 0.0
    query = torch.zeros_like(batch.query)
    query[:, :, 0] = 1 / batch.scale
    with torch_threads(threads):
        out = _attend(batch, rows, BF16, query)
    p_b = torch.tensor(math.exp(-1.25)).to(BF16).item()
    assert p_b == 147 / 512
    starts = batch.cu_seqlens_q.tolist()
    expected = torch.empty(query.shape[0], dtype=torch.float64)
    for s, marks in enumerate(is_b):
        for row in range(starts[s], starts[s + 1]):
            pos = len(marks) - (starts[s + 1] - row)
            num_b = sum(marks[t] for t in range(pos + 1))
            expected[row] = num_b * p_b / (pos + 1 - num_b + num_b * p_b)
    torch.testing.assert_close(out.double(), expected[:, None, None].expand(out.shape),
                               rtol=1e-5, atol=1e-7)


def test_the_flag_is_set_for_bf16_caches_with_bf16_compute() -> None:
    f32, bf16 = torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 16, dtype=BF16)
    kv_f32, kv_bf16 = native.KV_DTYPES[torch.float32], native.KV_DTYPES[BF16]
    assert native.kv_dtype_code(f32, f32) == kv_f32
    assert native.kv_dtype_code(f32, f32, BF16) == kv_f32  # float32 caches: float32 math
    assert native.kv_dtype_code(bf16, bf16) == kv_bf16
    assert native.kv_dtype_code(bf16, bf16, BF16) == kv_bf16 | native.ATTN_BF16_DOT
    assert native.ATTN_BF16_DOT & (kv_f32 | kv_bf16) == 0
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.kv_dtype_code(bf16, bf16, torch.float16)


def _raw_attention(lib: ctypes.CDLL, batch: PagedBatch, rows: NativeRows,
                   kv_dtype: int) -> tuple[int, torch.Tensor]:
    """plait_decode_attention of `batch` with this kv_dtype code as given: (rc, output)."""
    _, num_heads, head_dim = batch.query.shape
    _, block_size, num_kv_heads, _ = batch.k_cache.shape
    out = torch.zeros(batch.query.shape)
    rc = lib.plait_decode_attention(
        batch.query.data_ptr(), batch.query.stride(0), batch.k_cache.data_ptr(),
        batch.v_cache.data_ptr(), kv_dtype, block_size, num_kv_heads, num_heads, head_dim,
        batch.block_tables.data_ptr(), batch.block_tables.stride(0),
        rows.chunk_shared.shape[0], rows.chunk_start.data_ptr(), rows.chunk_shared.data_ptr(),
        rows.q_rows.data_ptr(), rows.table_rows.data_ptr(), rows.ctx_lens.data_ptr(),
        batch.scale, 0, 0.0, out.data_ptr(), rows.q_rows.data_ptr())
    return rc, out


@needs_native
def test_the_flag_with_float32_caches_is_refused() -> None:
    batch = bf16_batch(3, 64, 16)
    batch.k_cache, batch.v_cache = batch.k_cache.float(), batch.v_cache.float()
    rows = _plan(batch)
    kv_f32 = native.KV_DTYPES[torch.float32]
    assert _raw_attention(build.loaded(), batch, rows, kv_f32 | native.ATTN_BF16_DOT)[0] == -1
    rc, out = _raw_attention(build.loaded(), batch, rows, kv_f32)
    assert rc == 0 and torch.equal(out, _attend(batch, rows, torch.float32))


def test_a_build_without_avx512bf16_computes_float32(tmp_path, monkeypatch) -> None:
    """`-mno-avx512bf16`: the flag is taken and computes the float32 path's bits."""
    lib = library_without_avx512bf16(tmp_path)
    monkeypatch.setattr(native_attn, "loaded", lambda: lib)  # decode_attention's
    for group in (3, 7):
        batch = bf16_batch(group, 64, 16)
        rows = _plan(batch)
        with torch_threads(2):
            assert torch.equal(_attend(batch, rows, BF16), _attend(batch, rows, torch.float32))
