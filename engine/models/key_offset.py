"""The key offset: a constant subtracted from every key a layer stores in a bfloat16 cache.

Attention weighs a query's keys by softmax(scale q . k_j). Subtracting one vector c from
every key of a layer (per KV head) changes each score of query q by the same amount,
-scale q . c, for every j, and a softmax does not move when all its inputs move together:
the attention's output is the same in exact arithmetic, whatever c is. What c changes is
the rounding of the stored keys. A bfloat16 key keeps 8 significant bits, so its error
grows with |k|, and the scores' error with it.

Models with a k bias (Qwen2) have keys far from zero: the bias, rotated by each position's
angles, dominates them. On Qwen2.5-Coder-0.5B, layer 0's keys reach 145 with a spread of
38 around their mean, and bfloat16 storage moves its scores by 0.30 (rms), 0.019 with this
offset (`scripts/key_rounding.py`). The default mode's perplexity ratio against `--exact`
went from 1.0072 to 1.0016 on the GPL-3 text (BENCHMARKS.md, "The key offset").

c is the bias rotated at each of the first `POSITIONS` positions and averaged: a pair of
dims that RoPE turns slowly (most of them, at Qwen2.5's theta of 10^6) keeps nearly its
whole bias, a fast pair averages to nearly 0, and dims past the rotary width (or a NoPE
layer's) keep the bias as it is. It depends on the weights alone, so every process, step
and chunking stores the same bits for a token.

Not used where it would not be exact or would not help: a float32 cache (the exact mode
keeps its bits), no k bias, soft-capped scores (tanh is not shift-invariant), q/k norms
(the bias is then not what the stored keys hold).
"""

from __future__ import annotations

import torch

# Positions the rotated bias is averaged over (most requests' keys lie within them).
POSITIONS = 4096


def key_offset(
    k_bias: torch.Tensor,  # [H_kv * D] the k part of the q|k|v bias
    num_kv_heads: int,
    head_dim: int,
    cos_sin: torch.Tensor | None,  # [max_positions, R] cos | sin halves; None: a NoPE layer
) -> torch.Tensor:  # [H_kv, D] float32, on k_bias's device
    """The mean over positions [0, min(POSITIONS, max_positions)) of the bias rotated as
    `apply_rope` rotates a key (pairs (i, i + R/2) of each head, dims R.. unrotated)."""
    bias = k_bias.detach().to(torch.float64).reshape(num_kv_heads, head_dim)
    if cos_sin is None:
        return bias.float()
    rot = cos_sin.shape[-1]
    half = rot // 2
    mean = cos_sin[:POSITIONS].to(torch.float64).mean(0)  # [R]: mean cos | mean sin
    cos, sin = mean[:half], mean[half:]
    b1, b2 = bias[:, :half], bias[:, half:rot]
    out = bias.clone()
    out[:, :half] = b1 * cos - b2 * sin
    out[:, half:rot] = b2 * cos + b1 * sin
    return out.float().contiguous()


def uses_key_offset(cache_dtype: torch.dtype, has_bias: bool, softcap: float,
                    qk_norm: str | None) -> bool:
    """Whether a layer stores its keys less the offset (see the module's doc)."""
    return cache_dtype != torch.float32 and has_bias and not softcap and qk_norm is None


__all__ = ["POSITIONS", "key_offset", "uses_key_offset"]
