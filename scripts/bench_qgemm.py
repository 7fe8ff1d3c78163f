"""GEMM straight from GGUF blocks (`native.qgemm`, kernels/cpu/qgemm.c) on a model's shapes
and GGML types: ms per weight and GB/s of weights read, per row count.

Each projection has one copy per layer that holds it (random valid blocks), timed as one pass
over them, so the weights stream from memory as in a decode step; the last lines sum a
decode step's GEMMs. `--model smollm`: SmolLM2-135M Q4_1 (head Q8_0); `--model qwen`:
Qwen2.5-0.5B Q4_K_M (q|k|v Q5_0, v in Q8_0 in half the layers, down Q6_K / Q4_K by layer,
head Q8_0).

Without `--against`: qgemm against the float32 native panels (`native.gemm`) and against
dequantizing then BLAS. With `--against REV` (a git revision, or a folder of kernel sources):
that revision's kernels built into a second library, and its qgemm and the working tree's
interleaved call for call; medians of the calling thread's CPU time (all of it with
OMP_NUM_THREADS=1) and of wall time.

`--compute-dtype bfloat16`: the working tree's qgemm given the weights' bf16 descriptors
(`QuantWeight.desc_bf16`: bf16 products from `quant.BF16_MIN_ROWS` rows); with `--against`,
the other revision's qgemm is given `--against-dtype`'s descriptors (float32 by default:
what a revision without the bf16 batch path ran for these products).

    python scripts/bench_qgemm.py [--model qwen] [--rows 1,4,16] [--threads 2]
    OMP_NUM_THREADS=1 python scripts/bench_qgemm.py --model qwen --threads 1 --against HEAD
    OMP_NUM_THREADS=1 python scripts/bench_qgemm.py --threads 1 --against HEAD \
        --compute-dtype bfloat16 --rows 2,4,8,16 [--against-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from plait.kernels.cpu import build, native, quant
from plait.kernels.cpu.quant import QuantPart, QuantWeight

# model: (layers, {name: (K, ((GGML type, rows), ...), layers holding it: None = all)})
MODELS = {
    "smollm": (30, {
        "qkv": (576, ((quant.Q4_1, 960),), None), "o": (576, ((quant.Q4_1, 576),), None),
        "gate_up": (576, ((quant.Q4_1, 3072),), None),
        "down": (1536, ((quant.Q4_1, 576),), None), "head": (576, ((quant.Q8_0, 49152),), 1)}),
    "qwen": (24, {
        "qkv": (896, ((quant.Q5_0, 1152),), 12),
        "qkv_q8v": (896, ((quant.Q5_0, 1024), (quant.Q8_0, 128)), 12),
        "o": (896, ((quant.Q5_0, 896),), None), "gate_up": (896, ((quant.Q5_0, 9728),), None),
        "down_q6k": (4864, ((quant.Q6_K, 896),), 12),
        "down_q4k": (4864, ((quant.Q4_K, 896),), 12),
        "head": (896, ((quant.Q8_0, 151936),), 1)}),
}
# Byte offsets of each type's fp16 fields (scale, min): finite random values there.
FP16_FIELDS = {quant.Q4_0: (0,), quant.Q4_1: (0, 2), quant.Q5_0: (0,), quant.Q8_0: (0,),
               quant.Q4_K: (0, 2), quant.Q5_K: (0, 2), quant.Q6_K: (208,)}


def _random_weight(k: int, parts: tuple[tuple[int, int], ...],
                   rng: np.random.Generator) -> QuantWeight:
    """Random bytes for the quants, finite fp16 scale (and min) fields."""
    built = []
    for ggml_type, n in parts:
        per_block, nbytes = quant.block_shape(ggml_type)
        raw = rng.integers(0, 256, size=(n, k // per_block, nbytes), dtype=np.uint8)
        for at in FP16_FIELDS[ggml_type]:
            raw[..., at:at + 2] = rng.uniform(-0.01, 0.01, size=(n, k // per_block, 1)) \
                .astype(np.float16).view(np.uint8)
        built.append(QuantPart(torch.from_numpy(raw.reshape(n, -1)), ggml_type, n))
    return QuantWeight.build(built, k)


def _best_ms(fn, weights: list, x: torch.Tensor, repeats: int) -> float:
    """Best-of-`repeats` ms of one pass of fn(x, w) over the weights, per weight."""
    fn(x, weights[0])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3 / len(weights)


def _library_of(source: str) -> ctypes.CDLL:
    """The kernels of a git revision (or a folder holding them) built into a temp folder."""
    out = Path(tempfile.mkdtemp(prefix="plait_bench_"))
    for path in (*build.SOURCES, *build.HEADERS):
        if Path(source).is_dir():
            if not (Path(source) / path.name).exists():
                continue  # a header that revision does not have
            text = (Path(source) / path.name).read_text()
        else:
            shown = subprocess.run(["git", "-C", str(path.parent), "show",
                                    f"{source}:./{path.name}"], capture_output=True, text=True)
            if shown.returncode:
                continue  # a header that revision does not have
            text = shown.stdout
        (out / path.name).write_text(text)
    gomp = build._torch_gomp()
    subprocess.run(["cc", *build.FLAGS, "-o", str(out / "lib.so"),
                    *(str(out / p.name) for p in build.SOURCES), f"-L{gomp.parent}",
                    f"-Wl,-rpath,{gomp.parent}", "-lm"], check=True)
    lib = ctypes.CDLL(str(out / "lib.so"))
    lib.plait_qgemm.restype, lib.plait_qgemm.argtypes = build.ctypes_signature("plait_qgemm")
    return lib


def _pass(lib: ctypes.CDLL, x: torch.Tensor, weights: list, y: torch.Tensor,
          dtype: torch.dtype) -> tuple[float, float]:
    """(thread CPU s, wall s) of one pass of lib's qgemm over the weights, computing in
    `dtype` (the descriptor it is given)."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for w in weights:
        rc = lib.plait_qgemm(x.data_ptr(), x.shape[0], x.shape[1],
                             w.descriptor(dtype).data_ptr(),
                             x.shape[1], None, y.data_ptr(), y.shape[1])
        if rc:
            raise RuntimeError(f"plait_qgemm returned {rc}")
    return time.thread_time() - cpu, time.perf_counter() - wall


def _against(model: str, libs: dict[str, tuple[ctypes.CDLL, torch.dtype]],
             row_counts: list[int], repeats: int) -> None:
    """Each lib's qgemm (in its compute dtype) interleaved per repetition; medians per
    weight, GB/s, step sums."""
    layers, shapes = MODELS[model]
    rng = np.random.default_rng(0)
    names = list(libs)
    step = {(m, name): [0.0, 0.0] for m in row_counts for name in names}
    print(f"{'weight':9} {'N x K':>13} {'types':14} {'M':>3} " + " ".join(
        f"{name + ' cpu ms':>12} {'wall ms':>8} {'GB/s':>6}" for name in names))
    for label, (k, parts, copies) in shapes.items():
        weights = [_random_weight(k, parts, rng) for _ in range(copies or layers)]
        n = weights[0].out_features
        for m in row_counts:
            x, y = torch.randn(m, k), torch.empty(m, n)
            times = {name: [] for name in names}
            for _ in range(repeats):
                for name in names:
                    lib, dtype = libs[name]
                    times[name].append(_pass(lib, x, weights, y, dtype))
            cols = []
            for name in names:
                cpu, wall = (statistics.median(t[i] for t in times[name]) / len(weights)
                             for i in (0, 1))
                cols.append(f"{cpu * 1e3:12.3f} {wall * 1e3:8.3f} "
                            f"{weights[0].nbytes / wall / 1e9:6.1f}")
                step[m, name][0] += cpu * 1e3 * len(weights)
                step[m, name][1] += wall * 1e3 * len(weights)
            print(f"{label:9} {f'{n} x {k}':>13} {weights[0].describe():14} {m:3} "
                  + " ".join(cols))
    for (m, name), (cpu, wall) in step.items():
        print(f"decode step GEMMs, M={m:3}, {name:8}: cpu {cpu:8.2f} ms, wall {wall:8.2f} ms")


def _versus_panels(model: str, row_counts: list[int], repeats: int, threads: int,
                   dtype: torch.dtype) -> None:
    """qgemm (computing in `dtype`) against float32 panels and dequantize + torch.mm; ms
    per weight, GB/s."""
    layers, shapes = MODELS[model]
    rng = np.random.default_rng(0)
    step = {m: [0.0, 0.0, 0.0] for m in row_counts}
    print(f"{'weight':9} {'N x K':>13} {'types':14} {'M':>4} {'qgemm':>9} {'GB/s':>6} "
          f"{'f32 panels':>11} {'deq+mm':>9}   (ms per weight, {threads} threads)")
    for label, (k, parts, copies) in shapes.items():
        weights = [_random_weight(k, parts, rng) for _ in range(copies or layers)]
        n = weights[0].out_features
        panels = [native.pack_weight(native.dequantize(w)) for w in weights]
        for m in row_counts:
            x = torch.randn(m, k)
            times = (_best_ms(lambda x, w: native.qgemm(x, w, None, dtype), weights, x,
                              repeats),
                     _best_ms(lambda x, p, n=n: native.gemm(x, p, n), panels, x, repeats),
                     _best_ms(lambda x, w: x @ native.dequantize(w).T, weights, x, repeats))
            print(f"{label:9} {f'{n} x {k}':>13} {weights[0].describe():14} {m:4} "
                  f"{times[0]:9.3f} {weights[0].nbytes / times[0] / 1e6:6.1f} "
                  f"{times[1]:11.3f} {times[2]:9.3f}")
            for i, t in enumerate(times):
                step[m][i] += t * len(weights)
        del panels
    for m, (q, f, d) in step.items():
        print(f"decode step GEMMs, M={m:4}: qgemm {q:8.2f} ms, f32 panels {f:8.2f} ms, "
              f"deq+mm {d:8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm")
    parser.add_argument("--rows", default="1,4,16,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", metavar="REV_OR_DIR",
                        help="compare qgemm with the kernels of this git revision or folder")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the working tree's qgemm computes in this dtype")
    parser.add_argument("--against-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the --against revision's qgemm computes in this dtype")
    args = parser.parse_args()
    dtype = getattr(torch, args.compute_dtype)
    torch.set_num_threads(args.threads)
    if not build.available():
        raise SystemExit(f"native kernels unavailable: {build.unavailable_reason()}")
    row_counts = [int(r) for r in args.rows.split(",")]
    if args.against:
        libs = {args.against[:8]: (_library_of(args.against),
                                   getattr(torch, args.against_dtype)),
                "tree": (build.loaded(), dtype)}
        _against(args.model, libs, row_counts, args.repeats)
    else:
        _versus_panels(args.model, row_counts, args.repeats, args.threads, dtype)


if __name__ == "__main__":
    main()
