"""Repacked weights (`repack.repack_gemm`) against `native.qgemm` (blocks dequantized in
registers, float32 x), on Qwen2.5-0.5B's
shapes and the GGML types its Q4_K_M file stores them in (and Q4_K / Q4_1 at the same
shapes where K allows) and SmolLM2-135M's (Q4_1), per row count: microseconds per call and
effective GB/s (the weight's bytes as each path holds them, read once per call). `--paths`
names what runs: `qgemm`, and the repacked product's kernels by `repack.ISA_NAMES` (`c`,
`avx512-vnni`, `avx512-vnni+amx`: the same product with `kernel_isa` capped there); by
default `qgemm` and the build's fastest kernel.

Each weight has enough copies (random valid blocks) that one pass over them streams from
memory, as a decode step's GEMMs do; the figure is the fastest of `--passes` passes. The
machine's read bandwidth (`torch.sum` over 1 GiB, all threads) is printed first.

    flock /tmp/plait-bench.lock python scripts/bench_repack.py [--rows 1,16,64,256,512]
        [--threads 2] [--only gate_up,down] [--paths avx512-vnni,avx512-vnni+amx]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from plait.kernels.cpu import native, quant, repack
from plait.kernels.cpu.quant import QuantPart, QuantWeight

# (name, K, GGML type, N): Qwen2.5-0.5B's gate|up (Q5_0 in its file), down (Q6_K), LM head
# (its tied Q8_0 embedding); Q4_0 / Q4_1 / Q8_0 / Q4_K at the same shapes where K is a
# whole number of their blocks.
SHAPES = [("gate_up 896x4864 Q5_0", 896, quant.Q5_0, 4864),
          ("gate_up 896x4864 Q4_0", 896, quant.Q4_0, 4864),
          ("gate_up 896x4864 Q4_1", 896, quant.Q4_1, 4864),
          ("gate_up 896x4864 Q8_0", 896, quant.Q8_0, 4864),
          ("down 4864x896 Q6_K", 4864, quant.Q6_K, 896),
          ("down 4864x896 Q4_K", 4864, quant.Q4_K, 896),
          ("head 896x151936 Q8_0", 896, quant.Q8_0, 151936),
          ("qwen qkv 896x1152 Q5_0", 896, quant.Q5_0, 1152),
          ("qwen o 896x896 Q5_0", 896, quant.Q5_0, 896),
          ("smol qkv 576x960 Q4_1", 576, quant.Q4_1, 960),
          ("smol o 576x576 Q4_1", 576, quant.Q4_1, 576),
          ("smol gate_up 576x3072 Q4_1", 576, quant.Q4_1, 3072),
          ("smol down 1536x576 Q4_1", 1536, quant.Q4_1, 576),
          ("smol down 1536x576 Q4_0", 1536, quant.Q4_0, 576),
          ("smol down 1536x576 Q5_K", 1536, quant.Q5_K, 576),
          ("smol down 1536x576 Q8_0", 1536, quant.Q8_0, 576)]
STREAM_BYTES = 192 << 20  # copies of a weight until their blocks pass this
FP16_FIELDS = {quant.Q4_0: (0,), quant.Q4_1: (0, 2), quant.Q5_0: (0,), quant.Q8_0: (0,),
               quant.Q4_K: (0, 2), quant.Q5_K: (0, 2), quant.Q6_K: (208,)}


def random_weight(ggml_type: int, rows: int, k: int, rng: np.random.Generator) -> QuantWeight:
    per_block, nbytes = quant.block_shape(ggml_type)
    raw = rng.integers(0, 256, size=(rows, k // per_block, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[ggml_type]:
        scale = rng.uniform(-0.05, 0.05, size=(rows, k // per_block, 1)).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8)
    part = QuantPart(torch.from_numpy(raw.reshape(rows, -1)), ggml_type, rows)
    return QuantWeight.build([part], k)


def read_bandwidth() -> float:
    """GB/s of torch.sum over 1 GiB of float32 (the best of 5)."""
    big = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


def time_pass(calls: list[Callable[[], object]], passes: int) -> float:
    """Least seconds per call over `passes` passes through `calls` (the least disturbed by
    other processes on a shared machine)."""
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    return min(times)


def bench_shape(name: str, k: int, ggml_type: int, n: int, rows: list[int],
                passes: int, kernels: list[str]) -> None:
    rng = np.random.default_rng(0)
    one = random_weight(ggml_type, n, k, rng)
    copies = max(1, min(24, STREAM_BYTES // one.nbytes))
    weights = [one] + [random_weight(ggml_type, n, k, rng) for _ in range(copies - 1)]
    packed = [repack.repack(w) for w in weights]
    isas = {name: isa for isa, name in repack.ISA_NAMES.items()}
    print(f"{name}: {copies} copies; bytes file {one.nbytes / 1e6:.2f} MB, repacked "
          f"{packed[0].nbytes / 1e6:.2f} MB")
    for m in rows:
        x = torch.randn(m, k)
        paths: dict[str, tuple[int, list[Callable[[], object]]]] = {}
        for kernel in kernels:
            if kernel == "qgemm":
                paths[kernel] = (one.nbytes, [partial(native.qgemm, x, w) for w in weights])
            else:
                paths[kernel] = (packed[0].nbytes, [
                    partial(repack.repack_gemm, x, p, kernel_isa=isas[kernel]) for p in packed])
        cells = []
        for path, (size, calls) in paths.items():
            seconds = time_pass(calls, passes)
            cells.append(f"{path} {seconds * 1e6:8.0f} us {size / seconds / 1e9:5.1f} GB/s")
        print(f"  M={m:3d}  " + "  |  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--only", default="",
                        help="run the shapes whose name holds one of these (comma-separated)")
    parser.add_argument("--paths", default="",
                        help="comma-separated: qgemm and repacked kernels by name (default: "
                             "qgemm and the build's fastest)")
    args = parser.parse_args()
    kernels = (args.paths.split(",") if args.paths
               else ["qgemm", repack.ISA_NAMES[repack.isa()]])
    unknown = [k for k in kernels if k != "qgemm" and k not in repack.ISA_NAMES.values()]
    if unknown or any(repack.ISA_NAMES.get(isa, "") in kernels
                      for isa in repack.ISA_NAMES if isa > repack.isa()):
        parser.error(f"--paths {args.paths}: unknown, or beyond this build's "
                     f"{repack.ISA_NAMES[repack.isa()]}")
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, repack kernel {repack.ISA_NAMES[repack.isa()]}, "
          f"read bandwidth {read_bandwidth():.1f} GB/s")
    rows = [int(r) for r in args.rows.split(",")]
    for name, k, ggml_type, n in SHAPES:
        if any(part in name for part in args.only.split(",")):
            bench_shape(name, k, ggml_type, n, rows, args.passes, kernels)


if __name__ == "__main__":
    main()
