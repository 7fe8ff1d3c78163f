"""GEMM straight from GGUF blocks (`native.qgemm`, kernels/cpu/qgemm.c) against the float32
native panels (`native.gemm`) and against dequantizing then BLAS (`native.dequantize` +
torch.mm), on SmolLM2-135M Q4_1's shapes (its lm_head / embedding in Q8_0): ms per weight,
per row count.

Each projection has `--layers` copies of random valid blocks (the head one), timed as one
pass over them, so the weights stream from memory as in a decode step. The last lines sum a
decode step's GEMMs (30 layers of four projections and the head).

    python scripts/bench_qgemm.py [--rows 1,4,16,512] [--layers 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from plait.kernels.cpu import build, native, quant
from plait.kernels.cpu.quant import QuantPart, QuantWeight

# name: (N, K, GGML type, copies per pass: None = --layers)
SHAPES = {"qkv": (960, 576, quant.Q4_1, None), "o": (576, 576, quant.Q4_1, None),
          "gate_up": (3072, 576, quant.Q4_1, None), "down": (576, 1536, quant.Q4_1, None),
          "head": (49152, 576, quant.Q8_0, 1)}
MODEL_LAYERS = 30


def _random_weight(n: int, k: int, ggml_type: int, rng: np.random.Generator) -> QuantWeight:
    """Random bytes for the quants, finite fp16 scale (and min) fields."""
    per_block, nbytes = quant.block_shape(ggml_type)
    raw = rng.integers(0, 256, size=(n, k // per_block, nbytes), dtype=np.uint8)
    fields = 2 if ggml_type == quant.Q4_1 else 1
    raw[..., :2 * fields] = rng.uniform(-0.01, 0.01, size=(n, k // per_block, fields)) \
        .astype(np.float16).view(np.uint8)
    return QuantWeight.build([QuantPart(torch.from_numpy(raw.reshape(n, -1)), ggml_type, n)], k)


def _ms(fn, weights: list, x: torch.Tensor, repeats: int) -> float:
    """Best-of-`repeats` ms of one pass of fn(x, w) over the weights, per weight."""
    fn(x, weights[0])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,512")
    parser.add_argument("--layers", type=int, default=MODEL_LAYERS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not build.available():
        raise SystemExit(f"native kernels unavailable: {build.unavailable_reason()}")
    rng = np.random.default_rng(0)
    row_counts = [int(r) for r in args.rows.split(",")]
    step = {m: [0.0, 0.0, 0.0] for m in row_counts}
    print(f"{'weight':8} {'N x K':>12} {'type':5} {'M':>4} {'qgemm':>9} {'f32 panels':>11} "
          f"{'deq+mm':>9}   (ms per weight, {args.threads} threads)")
    for name, (n, k, ggml_type, copies) in SHAPES.items():
        weights = [_random_weight(n, k, ggml_type, rng) for _ in range(copies or args.layers)]
        panels = [native.pack_weight(native.dequantize(w)) for w in weights]
        for m in row_counts:
            x = torch.randn(m, k)
            times = (_ms(native.qgemm, weights, x, args.repeats),
                     _ms(lambda x, p, n=n: native.gemm(x, p, n), panels, x, args.repeats),
                     _ms(lambda x, w: x @ native.dequantize(w).T, weights, x, args.repeats))
            print(f"{name:8} {f'{n} x {k}':>12} {quant.type_name(ggml_type):5} {m:4} "
                  f"{times[0]:9.3f} {times[1]:11.3f} {times[2]:9.3f}")
            per_step = 1 if name == "head" else MODEL_LAYERS
            for i, t in enumerate(times):
                step[m][i] += t * per_step
        del panels
    for m, (q, f, d) in step.items():
        print(f"decode step GEMMs, M={m:4}: qgemm {q:8.2f} ms, f32 panels {f:8.2f} ms, "
              f"deq+mm {d:8.2f} ms")


if __name__ == "__main__":
    main()
