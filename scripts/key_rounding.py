"""How much storing keys in bfloat16 moves a model's attention scores, per layer, with and
without the key offset (engine/models/key_offset.py).

Runs one prompt (the start of a text) through `plait.LLM` with a float32 cache, catches each
layer's rotated queries and stored keys, and prints per layer: the keys' largest magnitude
and their spread, and the rms error of the causal scores q . k / sqrt(D) when each key is
stored as bfloat16(k - c) for c = 0 (no offset), c = the layer's key offset, and c = the
keys' own mean over this prompt (the best a constant can do here).

    python scripts/key_rounding.py --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from plait import LLM, SamplingParams
from plait.kernels import ops as ops_module


def score_error(q: torch.Tensor, k: torch.Tensor, offset: torch.Tensor) -> float:
    """rms over heads and causal (i, j) of the score error when k is stored as
    bfloat16(k - offset). q [T, H, D], k [T, H_kv, D], offset [H_kv, D]."""
    stored = (k - offset).bfloat16().float() + offset
    group, dim = q.shape[1] // k.shape[1], q.shape[2]
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    errors = []
    for h in range(q.shape[1]):
        exact = q[:, h] @ k[:, h // group].T / math.sqrt(dim)
        rounded = q[:, h] @ stored[:, h // group].T / math.sqrt(dim)
        errors.append((rounded - exact)[causal].pow(2).mean().sqrt().item())
    return sum(errors) / len(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--chars", type=int, default=2400, help="characters of the text")
    args = parser.parse_args()

    caught: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = ops_module.CpuNativeOps.rope_write_kv

    def spy(self, q, k, v, cos_sin, positions, k_cache, v_cache, slots, k_offset=None):
        q = original(self, q, k, v, cos_sin, positions, k_cache, v_cache, slots, k_offset)
        flat = k_cache.view(-1, *k_cache.shape[2:])
        caught.append((q.detach().clone().float(), flat[slots].clone().float()))
        return q

    ops_module.CpuNativeOps.rope_write_kv = spy  # type: ignore[method-assign]
    llm = LLM(args.model, num_kv_blocks=256, enable_prefix_caching=False,
              kv_cache_dtype="float32")
    layers = llm.engine.runner.model.decoder_layers()
    caught.clear()  # (the engine's warm-up pass)
    text = Path(args.text).read_text()[:args.chars]
    llm.generate([text], SamplingParams(max_tokens=1, temperature=0))
    model = llm.engine.runner.model
    print(f"{args.model}: {caught[0][1].shape[0]} tokens")
    print("| layer | max abs k | k spread (max std) | no offset | key offset | prompt mean |")
    print("|---|---|---|---|---|---|")
    for i, (layer, (q, k)) in enumerate(zip(layers, caught, strict=False)):
        zero = torch.zeros(k.shape[1:])
        table = model.cos_sin_local if layer.local_rope else model.cos_sin
        assert table is not None
        offset = layer.self_attn.key_offset(table)
        offset = zero if offset is None else offset
        print(f"| {i} | {k.abs().max():.1f} | {k.std(0).max():.2f} | "
              f"{score_error(q, k, zero):.4f} | {score_error(q, k, offset):.4f} | "
              f"{score_error(q, k, k.mean(0)):.4f} |")


if __name__ == "__main__":
    main()
