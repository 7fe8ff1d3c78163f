"""Row invariance of the native attention (kernels/cpu/attention.c): a query's result is
the same bits whichever way its row reaches the kernel (alone, as one row of a prefill
tile whose shared prefix ends anywhere before it, in a chunk of rows sharing a prompt's
blocks, among other sequences, on one thread or two), so that a draft's verification
rows, a prefill split at a cached prefix and one-row decode steps agree token for token
(issue 41: greedy output identical with and without speculation, in every numerics
mode). Every element type and compute dtype, block sizes that divide, equal and exceed
the vector width, and the variants (window, softcap)."""

from __future__ import annotations

import pytest
import torch
from helpers.threads import torch_threads

from plait.kernels.cpu import build, native

needs_native = pytest.mark.skipif(not build.available(), reason="native kernels unavailable")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
MODES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
         (torch.bfloat16, torch.bfloat16)]  # (cache, compute): the last takes bf16 dots


class Sequence:
    """One sequence of `length` tokens in a shuffled paged cache, a query per position."""

    def __init__(self, length: int, block_size: int, kv_dtype: torch.dtype, seed: int,
                 heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks = -(-length // block_size)
        shape = (blocks + 3, block_size, kv_heads, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen).to(kv_dtype)
        self.v = torch.randn(shape, generator=gen).to(kv_dtype)
        self.table = torch.randperm(blocks + 3, generator=gen)[:blocks].int()[None]
        self.q = torch.randn(length, heads, HEAD_DIM, generator=gen)

    def attend(self, chunks: list[tuple[int, list[int]]], compute: torch.dtype,
               **variants) -> torch.Tensor:  # [rows, H, D] in chunk order
        """chunks: (shared tokens, query positions); position p attends [0, p]."""
        start, shared, positions = [0], [], []
        for count, rows in chunks:
            shared.append(count)
            positions += rows
            start.append(len(positions))
        return native.decode_attention(
            self.q, self.k, self.v, self.table, torch.tensor(start),
            torch.tensor(shared, dtype=torch.int32), torch.tensor(positions),
            torch.zeros(len(positions), dtype=torch.int64),
            torch.tensor([p + 1 for p in positions], dtype=torch.int32), 0.125,
            compute_dtype=compute, **variants)


@needs_native
@pytest.mark.parametrize(("kv_dtype", "compute"), MODES)
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("variants", [{}, {"window": 37}, {"softcap": 3.0}])
def test_a_row_is_the_same_bits_however_it_comes(kv_dtype, compute, block_size,
                                                  variants) -> None:
    seq = Sequence(330, block_size, kv_dtype, seed=block_size)
    rows = list(range(297, 310))  # 13 rows: a verification step's or a prefill tile's
    alone = torch.cat([seq.attend([(0, [p])], compute, **variants) for p in rows])
    # every row alone in one call, among the others
    assert torch.equal(seq.attend([(0, [p]) for p in rows], compute, **variants), alone)
    # one tile whose shared prefix ends at its first row, on the slice grid, before it,
    # or at 0; and two tiles split elsewhere
    for shared in (297, 288, 250, 16, 0):
        assert torch.equal(seq.attend([(shared, rows)], compute, **variants), alone), shared
    split = seq.attend([(300, rows[3:]), (297, rows[:3])], compute, **variants)
    assert torch.equal(torch.cat([split[10:], split[:10]]), alone)
    # one, or the rows of a chunk, on another thread count
    for threads in (1, 2):
        with torch_threads(threads):
            assert torch.equal(seq.attend([(297, rows)], compute, **variants), alone)
            assert torch.equal(seq.attend([(0, [rows[-1]])], compute, **variants),
                               alone[-1:])


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (12, 2), (8, 2), (12, 4), (8, 8),
                                                 (10, 2), (16, 2)])
def test_lone_rows_take_their_heads_together_in_the_same_bits(heads, kv_heads) -> None:
    """Lone decode rows, enough of them for a task per row, walk their KV heads together
    (attention_bf16.h's few_heads: 3 heads at once for G <= 4, 2 for G <= 7, one for more)
    in the bits of one head at a time (each row alone: a task per KV head)."""
    seq = Sequence(150, 16, torch.bfloat16, seed=heads * kv_heads, heads=heads,
                   kv_heads=kv_heads)
    rows = list(range(120, 150, 2))  # 15 lone rows: a task per row on 1 or 2 threads
    alone = torch.cat([seq.attend([(0, [p])], torch.bfloat16) for p in rows])
    for threads in (1, 2):
        with torch_threads(threads):
            together = seq.attend([(0, [p]) for p in rows], torch.bfloat16)
        assert torch.equal(together, alone), threads


@needs_native
@pytest.mark.parametrize(("kv_dtype", "compute"), MODES)
def test_a_long_row_alone_is_the_bits_of_its_prefill(kv_dtype, compute) -> None:
    """A row alone over a long context (more blocks than the threads' tasks need, where the
    kernel once split it into merged pieces) equals the same position in prefill tiles."""
    seq = Sequence(1200, 16, kv_dtype, seed=3)
    for p in (1199, 700, 64):
        tile_start = p - p % 16
        with torch_threads(2):
            alone = seq.attend([(0, [p])], compute)
            tiled = seq.attend([(tile_start, list(range(tile_start, p + 1)))], compute)
        assert torch.equal(tiled[-1:], alone), p
