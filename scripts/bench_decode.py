"""Decode-attention bandwidth micro-benchmark (CUDA only; importing it needs no GPU).

`measure_decode_bandwidth` times `paged_attention_triton` on one decode step (one query
per sequence, every sequence `context_len` tokens long, blocks shuffled in the cache as a
fragmented real cache would be) with CUDA events, and reports the bytes the step must
move divided by its time:

    bytes = K + V read once per KV head   2 * num_seqs * context_len * H_kv * D * itemsize
          + query read + output written   2 * num_seqs * H * D * itemsize

`measure_copy_bandwidth` is the ceiling to compare with: a device-to-device copy, counting
read + write bytes. The target for long-context decode is >= 60% of it. Choose sizes far
above the L2 cache (50 MB on H100/H200), or K/V are re-read from L2 and the number is
inflated.

A script, not part of the package: `scripts/gpu_check.py` and the tests import it from its
path. Run alone it prints one configuration's figures:

    python scripts/bench_decode.py [--seqs 32] [--context 4096] [--heads 32] [--kv-heads 8]
                                   [--head-dim 128] [--block-size 16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("bench_decode needs a CUDA device (torch.cuda.is_available() is False)")


def _time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Mean milliseconds per call, measured with CUDA events around `iters` calls."""
    for _ in range(warmup):  # the first call also compiles the kernel
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def measure_decode_bandwidth(
    num_seqs: int,
    context_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None = None,
) -> dict:
    """Achieved GB/s of one decode step; `num_splits=None` uses the launcher's default.

    Returns {"time_ms", "gbps", "bytes", "kv_bytes", "num_splits"} (num_splits as
    passed). Allocates K/V of `kv_bytes` on the current CUDA device.
    """
    _require_cuda()
    from plait.kernels.cuda.attention import paged_attention_triton

    device = torch.device("cuda")
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype)  # [B, S, H_kv, D]
    v_cache = torch.randn(cache_shape, device=device, dtype=dtype)  # [B, S, H_kv, D]
    perm = torch.randperm(num_blocks, device=device)
    block_tables = perm.to(torch.int32).view(num_seqs, blocks_per_seq)  # [num_seqs, nb]
    query = torch.randn(num_seqs, num_heads, head_dim, device=device, dtype=dtype)
    cu_seqlens_q = torch.arange(num_seqs + 1, device=device, dtype=torch.int32)
    context_lens = torch.full((num_seqs,), context_len, device=device, dtype=torch.int32)

    def step() -> torch.Tensor:
        return paged_attention_triton(
            query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
            scale=head_dim**-0.5, max_query_len=1, max_context_len=context_len,
            num_splits=num_splits,
        )

    time_ms = _time_ms(step)
    itemsize = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * itemsize
    total = kv_bytes + 2 * query.numel() * itemsize
    return dict(
        time_ms=time_ms, gbps=total / (time_ms * 1e-3) / 1e9, bytes=total,
        kv_bytes=kv_bytes, num_splits=num_splits,
    )


def measure_copy_bandwidth(num_bytes: int) -> float:
    """Device-to-device copy GB/s of a `num_bytes` buffer, counting read + write bytes."""
    _require_cuda()
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")  # [num_bytes]
    dst = torch.empty_like(src)  # [num_bytes]
    time_ms = _time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (time_ms * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--splits", type=int, default=None)
    args = parser.parse_args()
    result = measure_decode_bandwidth(args.seqs, args.context, args.heads, args.kv_heads,
                                      args.head_dim, args.block_size,
                                      getattr(torch, args.dtype), args.splits)
    copy = measure_copy_bandwidth(2 << 30)
    print(f"decode: {result['gbps']:.0f} GB/s ({result['time_ms']:.3f} ms, "
          f"{result['kv_bytes'] / 1e6:.0f} MB of K/V); copy: {copy:.0f} GB/s; "
          f"{100 * result['gbps'] / copy:.0f}% of copy")


if __name__ == "__main__":
    main()
