"""Rotary position embeddings, including llama3-style frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


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


def rope_cos_sin(head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> torch.Tensor:  # [max_positions, D]
    """The neox-style RoPE table Hugging Face Llama checkpoints expect: cos | sin halves of
    each position's angles, float32 (computed in float64). Applied by the ops table
    (`rope_write_kv`; plait.kernels.ops.apply_rope)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], -1).float()
