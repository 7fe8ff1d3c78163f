"""Two or more builds of the native CPU kernels side by side in one process, on a real
model's repacked weights: each pass runs every repacked weight's product once against M
rows of x (a decode or prefill step's products, without the rest of the step), and the
builds take turns pass by pass, so a host whose speed drifts by minutes moves them alike.

    python scripts/bench_builds.py MODEL.gguf --rows 1 old=/path/a.so new=/path/b.so

A build is a compiled `plait_cpu_ops-*.so` (kernels/cpu/build.py caches each under
`~/.cache/plait/native/`, keyed by its sources): check out the sources of one variant,
print `plait.kernels.cpu.build.library()._name`, and repeat for the other. The weights are
repacked once by this checkout's build; the builds compared must read the same layout.

`--by-type` splits the figures by the weights' GGML part types (the LM head left out:
a prefill scores only its last row). Prints the median and the fastest pass per build,
milliseconds, and the weights' bytes over the fastest pass (GB/s).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from plait.engine.llm import LLM
from plait.engine.models.linear import Linear
from plait.kernels.cpu import build
from plait.kernels.cpu.quant import type_name
from plait.kernels.cpu.repack import REPACKED_FLAG as REPACKED

HEAD_ABOVE = 100_000  # output features past which a weight is an LM head


@dataclass(frozen=True, slots=True)
class _Weight:
    desc: torch.Tensor  # int64 descriptor
    in_features: int
    out_features: int
    nbytes: int
    kind: str  # its parts' types, e.g. "Q4_K+Q6_K"


def repacked_weights(model: torch.nn.Module) -> list[_Weight]:
    """Every repacked weight of the model's `Linear` layers, once each (a tied head shares
    its state), in memory order (its layers' order)."""
    seen: dict[int, _Weight] = {}
    for module in model.modules():
        state = module.state if isinstance(module, Linear) else None
        if (state is None or state.packed is None or state.desc is None
                or not int(state.desc[0]) & REPACKED):
            continue
        parts = int(state.desc[0]) & ~REPACKED
        kind = "+".join(type_name(int(state.desc[2 + 3 * i])) for i in range(parts))
        seen[state.packed.data_ptr()] = _Weight(state.desc, state.in_features,
                                                state.out_features, state.packed.numel(), kind)
    return [seen[k] for k in sorted(seen)]


def _bind(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name in ("plait_repack_gemm", "plait_repack_isa"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = build.ctypes_signature(name)
    return lib


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file (or any model the engine loads)")
    parser.add_argument("builds", nargs="+", metavar="NAME=PATH.so")
    parser.add_argument("--rows", type=int, default=1, help="M, x's rows")
    parser.add_argument("--passes", type=int, default=8)
    parser.add_argument("--by-type", action="store_true")
    args = parser.parse_args(argv)
    builds = dict(spec.split("=", 1) for spec in args.builds)
    llm = LLM(args.model)
    weights = repacked_weights(llm.engine.runner.model)
    if not weights:
        raise SystemExit("the model holds no repacked weights (its products take another row)")
    groups: dict[str, list[_Weight]] = {}
    for w in weights:
        if args.by_type and w.out_features > HEAD_ABOVE:
            continue
        groups.setdefault(w.kind if args.by_type else "all", []).append(w)
    libs = {name: _bind(path) for name, path in builds.items()}
    isa = min(int(lib.plait_repack_isa()) for lib in libs.values())
    gen = torch.Generator().manual_seed(0)
    xs = {id(w): torch.randn(args.rows, w.in_features, generator=gen) for w in weights}
    ys = {id(w): torch.empty(args.rows, w.out_features) for w in weights}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.passes):
        for kind, group in groups.items():
            for name, lib in libs.items():
                start = time.perf_counter()
                for w in group:
                    rc = lib.plait_repack_gemm(
                        xs[id(w)].data_ptr(), args.rows, w.in_features, w.desc.data_ptr(),
                        w.in_features, None, ys[id(w)].data_ptr(), w.out_features, isa)
                    if rc != 0:
                        raise SystemExit(f"{name}: plait_repack_gemm returned {rc}")
                times.setdefault((kind, name), []).append(time.perf_counter() - start)
    print(f"{args.model}: M = {args.rows}, {args.passes} passes, builds taking turns")
    for kind, group in groups.items():
        nbytes = sum(w.nbytes for w in group)
        print(f"{kind}: {len(group)} weights, {nbytes / 1e9:.3f} GB")
        for name in libs:
            t = times[(kind, name)]
            print(f"  {name:>12}  median {1000 * statistics.median(t):8.1f} ms  "
                  f"fastest {1000 * min(t):8.1f} ms  {nbytes / min(t) / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
