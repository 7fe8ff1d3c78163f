"""The key offset (engine/models/key_offset.py): its value, where it is used, and that it
brings a bfloat16 cache's logits nearer the float32 cache's on a model whose k bias
dominates its keys."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engine import prompt
from helpers.model import PagedHarness, load_model
from helpers.tiny_model import make_tiny_model

from plait.engine.models import layers as layers_mod
from plait.engine.models.key_offset import POSITIONS, key_offset, uses_key_offset
from plait.engine.models.rope import rope_cos_sin
from plait.kernels.ops import apply_rope


@pytest.mark.parametrize(("rot", "max_positions"), [(64, 8192), (48, 8192), (64, 1000)])
def test_key_offset_is_the_bias_rotated_and_averaged(rot, max_positions) -> None:
    """The mean over the first min(POSITIONS, table rows) positions of the bias rotated as
    `apply_rope` rotates a key; dims past the rotary width keep the bias."""
    gen = torch.Generator().manual_seed(rot)
    kv_heads, head_dim = 2, 64
    bias = 20 * torch.randn(kv_heads * head_dim, generator=gen)
    cos_sin = rope_cos_sin(rot, max_positions, 1e6, None)
    positions = torch.arange(min(POSITIONS, max_positions))
    keys = bias.view(1, kv_heads, head_dim).expand(len(positions), -1, -1).double()
    _, rotated = apply_rope(cos_sin.double(), positions, keys.clone(), keys.clone())
    got = key_offset(bias, kv_heads, head_dim, cos_sin)
    assert got.dtype == torch.float32 and got.shape == (kv_heads, head_dim)
    torch.testing.assert_close(got.double(), rotated.mean(0), atol=1e-5, rtol=1e-6)
    assert torch.equal(got[:, rot:], bias.view(kv_heads, head_dim)[:, rot:])
    # the slowest pair keeps nearly its whole bias, the fastest averages to nearly 0
    slow, fast = rot // 2 - 1, 0
    assert torch.allclose(got[:, slow], bias.view(kv_heads, head_dim)[:, slow], rtol=0.05)
    assert got[:, fast].abs().max() < 0.02 * bias.abs().max()
    # a NoPE layer: the bias itself
    assert torch.equal(key_offset(bias, kv_heads, head_dim, None),
                       bias.view(kv_heads, head_dim))


def test_where_the_offset_is_used() -> None:
    assert uses_key_offset(torch.bfloat16, True, 0.0, None)
    assert uses_key_offset(torch.float16, True, 0.0, None)
    assert not uses_key_offset(torch.float32, True, 0.0, None)  # the exact mode's bits
    assert not uses_key_offset(torch.bfloat16, False, 0.0, None)  # no k bias
    assert not uses_key_offset(torch.bfloat16, True, 50.0, None)  # tanh: not shift-invariant
    assert not uses_key_offset(torch.bfloat16, True, 0.0, "head")  # the norm follows the bias


def _logits(model, kv_dtype: torch.dtype) -> torch.Tensor:
    """The logits of a 40-token prompt, then of 3 decode steps, through a cache of
    `kv_dtype` (the layer loop and the native stack both run)."""
    harness = PagedHarness(model.config, num_blocks=24, block_size=4, kv_dtype=kv_dtype)
    tokens = prompt(3, 43)
    table = list(range(11))
    out = [harness.run(model, [(tokens[:40], 0, table)])[0]]
    for n in (41, 42, 43):
        out.append(harness.run(model, [(tokens[:n], n - 1, table)])[0])
    return torch.cat(out)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_cache_nearer_float32_with_the_offset(tmp_path, default_model, monkeypatch,
                                                   native) -> None:
    """A tiny Qwen2 whose k bias is large (as Qwen2.5's are): the bfloat16 cache's logits
    are nearer the float32 cache's with the offset than without it (largest logit error
    measured 0.0063 against 0.083), through the native kernels and through the torch path; a
    float32 cache has no offset."""
    path = make_tiny_model(tmp_path / "qwen2", default_model.path, "qwen2", seed=3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"rope_theta": 1e6}))  # Qwen2.5's
    model = load_model(path, 2048, native=native)
    for layer in model.decoder_layers():
        attn = layer.self_attn
        q_size, kv_size, _ = attn.split
        k_bias = attn.qkv_proj.bias[q_size:q_size + kv_size].view(attn.num_kv_heads, -1)
        half = attn.head_dim // 2
        slow = [half - 2, half - 1, 2 * half - 2, 2 * half - 1]  # the two slowest pairs
        with torch.no_grad():
            k_bias[:, slow] *= 100  # |b| ~ 50 where RoPE turns slowly, as in Qwen2.5
    reference = _logits(model, torch.float32)
    assert all(layer.self_attn.k_offset is None for layer in model.decoder_layers())
    with_offset = _logits(model, torch.bfloat16)
    assert all(layer.self_attn.k_offset is not None for layer in model.decoder_layers())
    monkeypatch.setattr(layers_mod, "uses_key_offset", lambda *args: False)
    without = _logits(model, torch.bfloat16)
    assert all(layer.self_attn.k_offset is None for layer in model.decoder_layers())
    err_with = (with_offset - reference).abs().max().item()
    err_without = (without - reference).abs().max().item()
    assert err_with < err_without / 5, (err_with, err_without)
