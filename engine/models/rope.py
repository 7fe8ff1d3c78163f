"""Rotary position embeddings: the cos | sin table of each position, with the frequency
scalings Hugging Face and llama.cpp implement (`SCALINGS`):

    linear     every frequency divided by `factor`
    llama3     low frequencies / `factor`, high ones kept, a smooth ramp in between
    yarn       NTK-by-parts: interpolated below a ramp of dims, extrapolated above it;
               cos and sin times the attention factor (0.1 ln(factor) + 1 by default)
    longrope   each frequency divided by its own factor: `long_factor` when the engine's
               context exceeds `original_max_position_embeddings`, else `short_factor`;
               cos and sin times sqrt(1 + ln(factor) / ln(original)) by default

transformers picks longrope's factor set per forward from the sequence's length; a paged
engine cannot re-rotate cached keys, so the set is chosen once from the context the table
is built for, as llama.cpp chooses it from its context size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from plait.engine.model_config import ROPE_SCALINGS as SCALINGS


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Scale low frequencies by `factor`, keep high ones, interpolate in between."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float,
          scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """NTK-by-parts frequencies and the attention factor (the YaRN paper, eqs. 17-21)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)  # [dim / 2]
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) \
            if mscale and mscale_all else _yarn_mscale(factor)
    return inv_freq, float(attention)


def _longrope(inv_freq: torch.Tensor, max_positions: int,
              scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Per-frequency factors (module docstring) and the attention factor."""
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    chosen = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    ext = torch.tensor(chosen, dtype=torch.float64)
    if ext.shape != inv_freq.shape:
        raise ValueError(f"longrope: {ext.numel()} factors for {inv_freq.numel()} frequencies")
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / ext, float(attention)


def _scaled(inv_freq: torch.Tensor, rotary_dim: int, max_positions: int, theta: float,
            scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """The scaled frequencies and the attention factor of `scaling`."""
    kind = scaling.get("rope_type", "llama3")  # a dict without a type: Plait's llama3 one
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "yarn":
        return _yarn(inv_freq, rotary_dim, theta, scaling)
    if kind == "longrope":
        return _longrope(inv_freq, max_positions, scaling)
    raise ValueError(f"unknown RoPE scaling {kind!r}; known: {', '.join(SCALINGS)}")


def rope_cos_sin(rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> torch.Tensor:  # [max_positions, R]
    """The neox-style RoPE table Hugging Face checkpoints expect: cos | sin halves of each
    position's angles over the first `rotary_dim` (R) dims of a head, float32 (computed in
    float64), times the scaling's attention factor. Applied by the ops table
    (`rope_write_kv`; plait.kernels.ops.apply_rope)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64)
                               / rotary_dim)
    attention = 1.0
    if scaling is not None:
        inv_freq, attention = _scaled(inv_freq, rotary_dim, max_positions, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], -1)
    return (table if attention == 1.0 else table * attention).float()
