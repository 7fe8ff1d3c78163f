"""The native CPU attention alone (`native.decode_attention`, one layer), over a float32 or
bfloat16 KV cache. Two cases:

* decode (default): `--seqs` rows of `--ctx` tokens each, their blocks scattered over a pool
  (as a fragmented cache), each row alone or all sharing their first `--shared` tokens (one
  chunk: n choices of one prompt);
* `--prefill N`: one prefill chunk of N query positions over a context of N tokens, in the
  tiles the engine sends (`attention.plan_native`: each tile's rows share the tokens before
  it, then attend their own few).

`--compute-dtype bfloat16` over a bfloat16 cache takes the engine's `--compute-dtype
bfloat16` path (vdpbf16ps dot products for every token, where the build has
AVX512-BF16); `--prompt-rows` with them, the prompt pass's AMX tiles (attention_amx.h,
where `native.prompt_attention_amx()`). Prints the minimum, 10th percentile and median
milliseconds per call over `--iters` calls (the minimum is the figure on a busy machine).

    python scripts/bench_cpu_attention.py [--kv-cache-dtype float32|bfloat16]
        [--compute-dtype float32|bfloat16] [--ctx 560] [--seqs 16] [--shared 0]
        [--prefill 0] [--heads 9] [--kv-heads 3] [--head-dim 64] [--iters 300]
        [--prompt-rows]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from plait.kernels.cpu import native
from plait.kernels.cpu.attention import native_attention, plan_native


def _decode_call(args: argparse.Namespace, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 compute_dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """`--seqs` decode rows of `--ctx` tokens, alone or sharing `--shared` tokens."""
    bs, seqs = args.block_size, args.seqs
    if args.shared % bs or args.shared >= args.ctx:
        raise SystemExit("--shared must be whole blocks, fewer than --ctx tokens")
    width = -(-args.ctx // bs)
    tables = torch.randperm(k_cache.shape[0])[:seqs * width].view(seqs, width).int()
    tables[:, :args.shared // bs] = tables[0, :args.shared // bs]  # [seqs, width]
    query = torch.randn(seqs, args.heads, args.head_dim)  # [seqs, H, D]
    shared = args.shared > 0
    rows = dict(chunk_start=torch.tensor([0, seqs]) if shared else torch.arange(seqs + 1),
                chunk_shared=torch.tensor([args.shared] if shared else [0] * seqs,
                                          dtype=torch.int32),
                q_rows=torch.arange(seqs), table_rows=torch.arange(seqs),
                ctx_lens=torch.full((seqs,), args.ctx, dtype=torch.int32))
    scale = args.head_dim ** -0.5
    return lambda: native.decode_attention(query, k_cache, v_cache, tables, scale=scale,
                                           compute_dtype=compute_dtype,
                                           prompt_rows=args.prompt_rows, **rows)


def _prefill_call(args: argparse.Namespace, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  compute_dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One prefill chunk of `--prefill` positions from 0, planned as the engine plans it."""
    n, bs = args.prefill, args.block_size
    width = -(-n // bs)
    tables = torch.randperm(k_cache.shape[0])[:width].view(1, width).int()  # [1, width]
    query = torch.randn(n, args.heads, args.head_dim)  # [n, H, D]
    rows = plan_native(torch.tensor([0, n], dtype=torch.int32),
                       torch.tensor([n], dtype=torch.int32), tables, bs,
                       args.heads // args.kv_heads, n, n)
    scale = args.head_dim ** -0.5
    return lambda: native_attention(query, k_cache, v_cache, tables, rows, scale,
                                    compute_dtype, prompt_rows=args.prompt_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ctx", type=int, default=560)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--shared", type=int, default=0, help="tokens shared (whole blocks)")
    parser.add_argument("--prefill", type=int, default=0,
                        help="query positions of one prefill chunk (0: the decode case)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--prompt-rows", action="store_true",
                        help="the prompt pass's AMX tiles (bfloat16 cache and compute)")
    args = parser.parse_args()
    torch.manual_seed(0)
    width = -(-max(args.ctx, args.prefill) // args.block_size)
    num_blocks = max(4096, args.seqs * (width + 2))
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    dtype = getattr(torch, args.kv_cache_dtype)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    compute_dtype = getattr(torch, args.compute_dtype)
    make = _prefill_call if args.prefill else _decode_call
    call = make(args, k_cache, v_cache, compute_dtype)
    for _ in range(20):
        call()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    what = (f"a {args.prefill}-token prefill chunk" if args.prefill else
            f"{args.seqs} rows x {args.ctx} tokens ({args.shared} shared)")
    if args.prompt_rows:
        what += ", prompt rows (AMX tiles)"
    print(f"{args.kv_cache_dtype} KV, {args.compute_dtype} compute, {what}, "
          f"H={args.heads} H_kv={args.kv_heads} D={args.head_dim}: min {times[0]:.3f} ms, "
          f"p10 {times[len(times) // 10]:.3f} ms, median {statistics.median(times):.3f} ms "
          "per call")


if __name__ == "__main__":
    main()
