"""The dense CPU rows of the product table (kernels/cpu/products.py) on the default model's
projection shapes: ms for one pass over all 30 layers' 120 weights, per row count. The column
`native` is what the engine runs with the native kernels (the panels/<blas> row: native
panels up to NATIVE_MAX_ROWS rows, the default BLAS row above); the others are each BLAS
row alone (`none` is torch's GEMM on the plain weight, the "torch" row).

Each row holds its own copy of 30 layers of random weights, so a pass streams them from
memory as a decode step does (no weight stays in cache between layers).

    python scripts/bench_gemm.py [--rows 1,16,64,128,512] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from plait.engine.models.linear import Linear, resolve_cpu_gemm
from plait.kernels.cpu import build
from plait.kernels.cpu.products import BLAS, Product, row

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536 (fused gate+up)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def _blas_rows() -> dict[str, Product]:
    """The BLAS rows this torch runs: plain always, MKL and oneDNN where built in."""
    usable = {"none": True,
              "mkl": torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"),
              "onednn": torch.backends.mkldnn.is_available()}
    return {name: BLAS[name] for name, ok in usable.items() if ok}


def _layers(product: Product) -> dict[str, list[Linear]]:
    """30 layers of random float32 weights per projection, each on `product`."""
    layers = {}
    for name, (n, k) in SHAPES.items():
        group = []
        for _ in range(LAYERS):
            plain = Linear(k, n, bias=False)
            assert plain.weight is not None
            torch.nn.init.normal_(plain.weight, std=0.02)
            plain.select(product)
            group.append(plain)
        layers[name] = group
    return layers


def _pass_ms(layers: dict[str, list[Linear]], rows: int, repeats: int) -> float:
    inputs = {name: torch.randn(rows, k) for name, (_, k) in SHAPES.items()}

    def one_pass() -> None:
        for name, group in layers.items():
            for layer in group:
                layer(inputs[name])

    for _ in range(2):
        one_pass()
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,128,512")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        models = {name: _layers(product) for name, product in _blas_rows().items()}
        if build.available():  # the engine's: panels over its default BLAS row
            panels = row(f"panels/{BLAS[resolve_cpu_gemm()].name}")
            models = {"native": _layers(panels), **models}
        packings = list(models)
        print("rows  " + "  ".join(f"{p:>8}" for p in packings) + "   (ms per pass)")
        for rows in (int(r) for r in args.rows.split(",")):
            repeats = 8 if rows < 200 else 3
            times = [_pass_ms(models[p], rows, repeats) for p in packings]
            print(f"{rows:4d}  " + "  ".join(f"{t:8.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
