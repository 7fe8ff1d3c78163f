"""The engine's numerics: one choice (`EngineConfig.numerics`) resolved once at start.

Three modes, each a superset of the one below it in speed and a step away from exact
float32 arithmetic:

* ``int8`` (the default for a GGUF file on a CPU with AVX512-VNNI): a GGUF's quantized
  weights are repacked once at load at their own bit width (kernels/cpu/repack.py; the
  file's blocks are then released) and every product of them quantizes x to int8 per 32
  weights, as llama.cpp does; everything else is as ``bf16``.
* ``bf16``: the kept weights' products compute bf16 x bf16 with float32 sums, the KV cache
  holds bf16, and the attention takes bf16 dot products (every token, in one order
  whatever the step, kernels/cpu/attention.c: a token's attention does not depend on how
  many rows its step holds).
* ``exact``: float32 arithmetic on the dequantized weights, a float32 KV cache (on CPU):
  greedy output equals transformers' on the same weights.

``auto`` resolves to ``int8`` for a GGUF file on a float32 CPU engine whose native kernels
have the VNNI repacked product, and to ``exact`` everywhere else: a checkpoint's float
weights are the reference users compare against, and CUDA computes in the model dtype (the
numerics modes are the CPU engine's). Asking for ``int8`` or ``bf16`` where they cannot run
is an error at start, not a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.engine.config import NUMERICS


@dataclass(frozen=True, slots=True)
class Numerics:
    """A resolved mode: `name` ("int8", "bf16" or "exact"); `compute_dtype` the kept
    weights' products and the attention's dot products compute in (the engine's one copy);
    `kv_dtype` what `--kv-cache-dtype auto` stores (None: the model dtype); `repacked`
    whether the kept GGUF weights are repacked (the `repacked/<isa>` product row); `why`
    the reason, logged at start."""

    name: str
    compute_dtype: torch.dtype
    kv_dtype: torch.dtype | None
    repacked: bool
    why: str

    def describe(self) -> str:
        """One line for the startup log."""
        kv = "the model dtype" if self.kv_dtype is None else \
            str(self.kv_dtype).removeprefix("torch.")
        parts = [f"numerics: {self.name} ({self.why})",
                 f"products in {str(self.compute_dtype).removeprefix('torch.')}",
                 f"KV cache (auto): {kv}"]
        if self.repacked:
            parts.append("GGUF weights repacked at their own bit width, x as int8 per 32")
        return "; ".join(parts)


_MODES = {
    "int8": (torch.bfloat16, torch.bfloat16, True),
    "bf16": (torch.bfloat16, torch.bfloat16, False),
    "exact": (torch.float32, None, False),
}


def resolve_numerics(requested: str, device: torch.device, dtype: torch.dtype,
                     native: bool, vnni: bool, kept: bool = True,
                     gguf: bool = True) -> Numerics:
    """`requested` (one of NUMERICS) on an engine of `device` and activations `dtype`, with
    the native CPU kernels (`native`) and their VNNI repacked product (`vnni`) or not, the
    weights kept in their file's format (`kept`: `--weights auto`) or dequantized, of a
    GGUF file (`gguf`) or a checkpoint. ValueError where the mode cannot run there."""
    if requested not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {requested!r}")
    cpu_f32 = device.type == "cpu" and dtype == torch.float32
    if requested == "auto":
        if cpu_f32 and native and vnni and kept and gguf:
            return _mode("int8", "auto: a GGUF file on a CPU with AVX512-VNNI")
        why = "auto: " + ("not a float32 CPU engine" if not cpu_f32 else
                          "no native CPU kernels" if not native else
                          "--weights float32" if not kept else
                          "a checkpoint, not a GGUF file" if not gguf else
                          "the CPU has no AVX512-VNNI")
        return _mode("exact", why)
    if requested != "exact":
        if not cpu_f32:
            raise ValueError(f"--numerics {requested} runs on a float32 CPU engine (--device "
                             "cpu, --dtype auto or float32); this engine is "
                             f"{device.type} {str(dtype).removeprefix('torch.')}")
        if not native:
            raise ValueError(f"--numerics {requested} needs the native CPU kernels "
                             "(--native, and a C compiler to build them)")
        if not kept:
            raise ValueError(f"--numerics {requested} computes on the weights kept in their "
                             "file's format: it cannot run with --weights float32")
        if requested == "int8" and not vnni:
            raise ValueError("--numerics int8 needs a CPU with AVX512-VNNI (this one has "
                             "none); --numerics bf16 or exact run here")
    return _mode(requested, "asked for")


def _mode(name: str, why: str) -> Numerics:
    compute, kv, repacked = _MODES[name]
    return Numerics(name, compute, kv, repacked, why)


__all__ = ["NUMERICS", "Numerics", "resolve_numerics"]
