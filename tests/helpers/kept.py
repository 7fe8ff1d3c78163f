"""The default GGUF loaded in its own format (`--weights auto`) over a cache entry without
float32 weights, as the kept-format tests share it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plait.engine.config import EngineConfig
from plait.engine.model_loader import ResolvedModel, resolve_model
from plait.engine.model_runner import ModelRunner

# name in Plait -> the GGUF tensors of layer N it holds, in part order
FUSED = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
         "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def cache_without_weights(cache: Path, converted: Path) -> None:
    """A cache entry as the kept mode writes it: the converted directory's config and
    tokenizer files, no model.safetensors."""
    target = cache / converted.name
    target.mkdir(parents=True)
    for file in converted.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, target / file.name)


def kept_runner(cache: Path, default_model: ResolvedModel) -> ModelRunner:
    """A runner in the exact mode (the file's blocks kept) over the empty folder `cache`
    made a cache entry without float32 safetensors (and left without them)."""
    cache_without_weights(cache, default_model.path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAIT_CACHE", str(cache))
        resolved = resolve_model(None, float32_weights=False)
        runner = ModelRunner(EngineConfig(num_kv_blocks=16, numerics="exact"), resolved)
    assert not list(cache.glob("*/*.safetensors"))
    return runner
