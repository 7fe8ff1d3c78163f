"""Prompt rows' attention on AMX-BF16 tiles (kernels/cpu/attention_amx.h; kv_dtype
PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT | PLAIT_ATTN_AMX, `native.decode_attention(...,
prompt_rows=True)`): the engine's prompt pass on a host with AMX. Its roundings are those
of the bf16 dot products (the scaled queries and the softmax weights to bf16, nearest even;
K and V exact), so it meets test_attention_bf16_dot.py's bound against float64; its sums
run in another order, so its bits are its own; and a query's bits depend on its query and
its tokens only, never on its chunk, the chunk's shared prefix or the other rows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.kernel_cases import BF16, bf16_batch, bf16_reference
from helpers.threads import torch_threads

from plait.kernels.cpu import build, native
from plait.kernels.cpu.attention import native_attention, plan_native

needs_amx = pytest.mark.skipif(not build.available() or not native.prompt_attention_amx(),
                               reason="no AMX-BF16 prompt attention in this process")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(3, 64, 16), (7, 64, 16), (3, 128, 16), (6, 128, 16), (3, 64, 32),
                          (3, 64, 4), (1, 32, 8)])
def test_prompt_rows_are_within_the_rounding_of_p(group, head_dim, block_size,
                                                  threads) -> None:
    """Every row (rows sharing a prefix, prefill tiles, a lone long row) within the bound of
    p's rounding of float64 attention; and not the bits of the vdpbf16ps kernel (the flag
    took the tiles)."""
    batch = bf16_batch(group, head_dim, block_size)
    rows = plan_native(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                       block_size, group, batch.max_query_len, batch.max_context_len)
    with torch_threads(threads):
        out = native_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                               rows, batch.scale, BF16, prompt_rows=True)
        dot = native_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                               rows, batch.scale, BF16)
    expected, bound = bf16_reference(batch)
    excess = (out.double() - expected).abs() - bound
    assert excess.max().item() <= 1e-5
    assert not torch.equal(out, dot)


class Sequences:
    """Two sequences in one shuffled paged cache whose first `shared` blocks are the same
    blocks (a prompt's n choices), a query per position of each."""

    def __init__(self, length: int, block_size: int, shared: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks = -(-length // block_size)
        total = 2 * blocks - shared + 3
        shape = (total, block_size, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen).to(BF16)
        self.v = torch.randn(shape, generator=gen).to(BF16)
        ids = torch.randperm(total, generator=gen).int()
        second = torch.cat([ids[:shared], ids[blocks:2 * blocks - shared]])
        self.tables = torch.stack([ids[:blocks], second])  # [2, blocks]
        self.q = torch.randn(2, length, HEADS, HEAD_DIM, generator=gen)

    def attend(self, chunks: list[tuple[int, list[tuple[int, int]]]]) -> torch.Tensor:
        """chunks: (shared tokens, (sequence, position) rows); each row attends [0, p]."""
        start, shared, rows = [0], [], []
        for count, chunk in chunks:
            shared.append(count)
            rows += chunk
            start.append(len(rows))
        q = self.q.reshape(-1, HEADS, HEAD_DIM)
        length = self.q.shape[1]
        return native.decode_attention(
            q, self.k, self.v, self.tables, torch.tensor(start),
            torch.tensor(shared, dtype=torch.int32),
            torch.tensor([s * length + p for s, p in rows]),
            torch.tensor([s for s, _ in rows], dtype=torch.int64),
            torch.tensor([p + 1 for _, p in rows], dtype=torch.int32), 0.125,
            compute_dtype=BF16, prompt_rows=True)


@needs_amx
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_a_prompt_row_is_the_same_bits_however_it_comes(block_size) -> None:
    """A row alone; every row alone in one call; as a tile whose shared prefix ends anywhere;
    split into two tiles; among the rows of the other sequence (the chunk's shared blocks
    and each row's own); on one thread or two: the same bits."""
    seqs = Sequences(330, block_size, shared=160 // block_size, seed=block_size)
    rows = [(0, p) for p in range(297, 310)]  # 13 rows: a prefill tile's
    alone = torch.cat([seqs.attend([(0, [r])]) for r in rows])
    assert torch.equal(seqs.attend([(0, [r]) for r in rows]), alone)
    for shared in (297, 288, 250, 16, 0):
        assert torch.equal(seqs.attend([(shared, rows)]), alone), shared
    split = seqs.attend([(300, rows[3:]), (297, rows[:3])])
    assert torch.equal(torch.cat([split[10:], split[:10]]), alone)
    other = [(1, p) for p in (170, 200, 301)]
    mixed = seqs.attend([(160, [rows[0], other[0], rows[5], other[1], other[2], rows[-1]])])
    assert torch.equal(mixed[[0, 2, 5]], alone[[0, 5, 12]])
    assert torch.equal(mixed[[1, 3, 4]], torch.cat([seqs.attend([(0, [r])]) for r in other]))
    for threads in (1, 2):
        with torch_threads(threads):
            assert torch.equal(seqs.attend([(297, rows)]), alone)
            assert torch.equal(seqs.attend([(0, [rows[-1]])]), alone[-1:])


@needs_amx
@pytest.mark.parametrize("case", ["window", "softcap", "float32", "head_dim", "compute"])
def test_what_the_tiles_do_not_take_is_refused(case) -> None:
    """A window, a softcap, float32 caches or compute, head_dim not a multiple of 32: the
    kernel refuses (the engine asks `takes_prompt_rows` first), and says so."""
    head_dim = 48 if case == "head_dim" else HEAD_DIM
    cache = torch.randn(4, 16, KV_HEADS, head_dim)
    k, v = (cache, cache) if case == "float32" else (cache.to(BF16), cache.to(BF16))
    compute = torch.float32 if case == "compute" else BF16
    variants = {"window": {"window": 8}, "softcap": {"softcap": 3.0}}.get(case, {})
    assert not native.takes_prompt_rows(k, compute, head_dim, **variants)
    with pytest.raises((RuntimeError, ValueError)):
        native.decode_attention(
            torch.randn(1, HEADS, head_dim), k, v, torch.arange(4, dtype=torch.int32)[None],
            torch.tensor([0, 1]), torch.zeros(1, dtype=torch.int32), torch.zeros(1,
            dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            torch.tensor([20], dtype=torch.int32), 0.125, compute_dtype=compute,
            prompt_rows=True, **variants)
    bf16 = torch.randn(4, 16, KV_HEADS, HEAD_DIM).to(BF16)
    assert native.takes_prompt_rows(bf16, BF16, HEAD_DIM)


@pytest.mark.skipif(not build.available(), reason="native kernels unavailable")
def test_plait_repack_amx_0_turns_it_off() -> None:
    """With PLAIT_REPACK_AMX=0 (every AMX path off), prompt rows attend as generated rows."""
    env = {**os.environ, "PLAIT_REPACK_AMX": "0"}
    code = "from plait.kernels.cpu import native; print(native.prompt_attention_amx())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
