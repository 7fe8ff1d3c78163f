"""The CPU GEMM packings (engine/models/cpu_linear.py) on the default model's projection
shapes: ms for one pass over all 30 layers' 120 weights, per row count. The column `native`
is what the engine runs (the native panels up to NATIVE_MAX_ROWS rows, the default BLAS
packing above); the others are each BLAS packing alone.

Each packing holds its own copy of 30 layers of random weights, so a pass streams them from
memory as a decode step does (no weight stays in cache between layers).

    python scripts/bench_gemm.py [--rows 1,16,64,128,512] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from plait.engine.models.cpu_linear import (
    PACKINGS,
    default_packing,
    linear,
    prepack_cpu_linears,
)
from plait.kernels import native

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536 (fused gate+up)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def _layers(packing: str, panels: bool) -> dict[str, list[nn.Linear]]:
    layers = {name: [nn.Linear(k, n, bias=False) for _ in range(LAYERS)]
              for name, (n, k) in SHAPES.items()}
    for group in layers.values():
        prepack_cpu_linears(nn.Sequential(*group), packing)
        if not panels:
            for layer in group:
                layer.panel_weight = None
    return layers


def _pass_ms(layers: dict[str, list[nn.Linear]], rows: int, repeats: int) -> float:
    inputs = {name: torch.randn(rows, k) for name, (_, k) in SHAPES.items()}

    def one_pass() -> None:
        for name, group in layers.items():
            for layer in group:
                linear(layer, inputs[name])

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
    packings = [p for p in PACKINGS if p != "mkl" or torch.backends.mkl.is_available()]
    with torch.no_grad():
        models = {p: _layers(p, panels=False) for p in packings}
        if native.available():
            models = {"native": _layers(default_packing(), panels=True), **models}
        packings = list(models)
        print("rows  " + "  ".join(f"{p:>8}" for p in packings) + "   (ms per pass)")
        for rows in (int(r) for r in args.rows.split(",")):
            repeats = 8 if rows < 200 else 3
            times = [_pass_ms(models[p], rows, repeats) for p in packings]
            print(f"{rows:4d}  " + "  ".join(f"{t:8.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
