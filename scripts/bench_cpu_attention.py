"""The native CPU decode attention alone (`native.decode_attention`, one layer), over a
float32 or bfloat16 KV cache: `--seqs` rows of `--ctx` tokens each, their blocks scattered
over a pool (as a fragmented cache), each row alone or all sharing their first `--shared`
tokens (one chunk: n choices of one prompt). Prints the minimum, 10th percentile and median
milliseconds per call over `--iters` calls (the minimum is the figure on a busy machine).

    python scripts/bench_cpu_attention.py [--kv-cache-dtype float32|bfloat16] [--ctx 560]
        [--seqs 16] [--shared 0] [--heads 9] [--kv-heads 3] [--head-dim 64] [--iters 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from plait.kernels.cpu import native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ctx", type=int, default=560)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--shared", type=int, default=0, help="tokens shared (whole blocks)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    bs, seqs = args.block_size, args.seqs
    if args.shared % bs or args.shared >= args.ctx:
        raise SystemExit("--shared must be whole blocks, fewer than --ctx tokens")
    torch.manual_seed(0)
    width = -(-args.ctx // bs)
    num_blocks = max(4096, seqs * (width + 2))
    shape = (num_blocks, bs, args.kv_heads, args.head_dim)
    dtype = getattr(torch, args.kv_cache_dtype)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    tables = torch.randperm(num_blocks)[:seqs * width].view(seqs, width).int()
    tables[:, :args.shared // bs] = tables[0, :args.shared // bs]  # [seqs, width]
    query = torch.randn(seqs, args.heads, args.head_dim)  # [seqs, H, D]
    shared = args.shared > 0
    rows = dict(chunk_start=torch.tensor([0, seqs]) if shared else torch.arange(seqs + 1),
                chunk_shared=torch.tensor([args.shared] if shared else [0] * seqs,
                                          dtype=torch.int32),
                q_rows=torch.arange(seqs), table_rows=torch.arange(seqs),
                ctx_lens=torch.full((seqs,), args.ctx, dtype=torch.int32))
    scale = args.head_dim ** -0.5
    for _ in range(20):
        native.decode_attention(query, k_cache, v_cache, tables, scale=scale, **rows)
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        native.decode_attention(query, k_cache, v_cache, tables, scale=scale, **rows)
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    print(f"{args.kv_cache_dtype} KV, {seqs} rows x {args.ctx} tokens ({args.shared} shared): "
          f"min {times[0]:.3f} ms, p10 {times[len(times) // 10]:.3f} ms, "
          f"median {statistics.median(times):.3f} ms per call")


if __name__ == "__main__":
    main()
