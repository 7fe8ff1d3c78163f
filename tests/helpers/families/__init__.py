"""Tiny random-weight Hugging Face checkpoints of the model families the engine serves, built
offline from transformers' own config and model classes, for parity tests.

    tiny_family_checkpoint("qwen3") -> $PLAIT_CACHE/test-families/qwen3-<digest>/
        config.json, model.safetensors (float32), tokenizer files

Each family's spec (FAMILIES) is a small config with widths that are multiples of 256 where
K-quant blocks need them (hidden 256, intermediate 512), 2 to 6 layers, and the family's
distinguishing features switched on. The weights are transformers' random init redrawn from a
fixed seed at a larger scale (peaky logits, so greedy tokens differ between prompts and are
stable under float rounding). A checkpoint is written once per spec: the directory name holds
a digest of the spec, the seed, the tokenizer and the transformers version, and it is written
aside and renamed, so concurrent test processes never read a half-written one.

Tokenizers (tokenizers.py): the SmolLM2 tokenizer (49,152 tokens) for most families; a
1,024-piece SentencePiece model trained on a licence text for gemma2, gemma3 (Gemma ids) and
phi3 (Llama ids), whose llama.cpp converters read tokenizer.model.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.engine.model_loader import cache_root

from .tokenizers import SPM_VOCAB, build_once, tokenizer_identity, write_tokenizer

SMOLLM2_VOCAB = 49152
HIDDEN = 256
INTERMEDIATE = 512


@dataclass(frozen=True)
class FamilySpec:
    """One family's tiny checkpoint: transformers' `model_type` (AutoConfig.for_model picks
    the config class), the config's keyword arguments, and the tokenizer it is saved with.

    `tokenizer` is "smollm2" (GPT-2 style BPE) or "spm" (a SentencePiece model trained on a
    licence text; the families whose llama.cpp converter reads tokenizer.model)."""

    model_type: str
    config: dict[str, Any]
    tokenizer: str = "smollm2"
    weight_std: float = 0.1  # std of every 2-D weight; 1-D weights get init + N(0, 0.1)
    # std of the token embedding, where the family scales it up (Gemma by sqrt(hidden),
    # Granite by embedding_multiplier): kept small there, or the tied output head sees the
    # current token's own embedding dominate the last hidden state and greedy repeats it.
    embed_std: float | None = None
    # the final norm's effective weight times this: logits of a useful size despite a small
    # tied embedding (Gemma's norm weight w acts as 1 + w)
    final_norm_gain: float = 1.0


def _common(**over: Any) -> dict[str, Any]:
    """The shared tiny shape: hidden 256, 4 query heads of 64, 2 KV heads, 2 layers, the
    SmolLM2 vocabulary and its ids (bos 1, eos 2)."""
    base: dict[str, Any] = dict(
        vocab_size=SMOLLM2_VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=None)
    base.update(over)
    return base


# Phi-3's longrope: one factor per rotary frequency (rotary dim 32 -> 16), the short ones
# used up to original_max_position_embeddings, the long ones past it.
_PHI3_ROTARY_HALF = 16
_PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "original_max_position_embeddings": 1024,
              "short_factor": [1.0 + 0.05 * i for i in range(_PHI3_ROTARY_HALF)],
              "long_factor": [1.0 + 0.5 * i for i in range(_PHI3_ROTARY_HALF)]}

FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", _common(tie_word_embeddings=True)),
    "qwen2": FamilySpec("qwen2", _common(tie_word_embeddings=False)),
    # head_dim 64 with 8 query heads: q_proj is 256 -> 512, so head_dim != hidden / heads
    # (qwen3.attention.key_length must come from head_dim).
    "qwen3": FamilySpec("qwen3", _common(num_hidden_layers=3, num_attention_heads=8,
                                         head_dim=64, tie_word_embeddings=True)),
    # 6 layers on the default pattern (5 sliding, then 1 global) with a 16-token window; one
    # KV head. query_pre_attn_scalar == head_dim: llama.cpp's GGUF has no key for it and
    # scales by 1/sqrt(head_dim).
    "gemma3": FamilySpec("gemma3_text", dict(
        vocab_size=SPM_VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=16, max_position_embeddings=2048,
        rms_norm_eps=1e-6), tokenizer="spm-gemma", embed_std=0.01, final_norm_gain=10.0),
    # 4 layers alternating sliding (even) and global (odd), window 16, soft-caps 50 and 30.
    "gemma2": FamilySpec("gemma2", dict(
        vocab_size=SPM_VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, max_position_embeddings=2048, rms_norm_eps=1e-6),
        tokenizer="spm-gemma", embed_std=0.01, final_norm_gain=10.0),
    # Rotary dim 32 of head_dim 64, longrope with 16 short and 16 long factors.
    "phi3": FamilySpec("phi3", _common(vocab_size=SPM_VOCAB, max_position_embeddings=4096,
                                       original_max_position_embeddings=1024,
                                       rope_parameters=_PHI3_ROPE, tie_word_embeddings=False),
                       tokenizer="spm-llama"),
    # Every multiplier away from 1 (and attention's away from 1/sqrt(head_dim) = 0.125).
    # Untied: with embedding_multiplier 12 and residual_multiplier 0.22 a tied head mostly
    # sees the current token's own embedding.
    "granite": FamilySpec("granite", _common(embedding_multiplier=12.0, attention_multiplier=0.1,
                                             residual_multiplier=0.22, logits_scaling=2.0,
                                             tie_word_embeddings=False), embed_std=0.02),
    # 4 layers; no_rope_layer_interval 4 gives no_rope_layers [1, 1, 1, 0]: layer 3 has no rope.
    "smollm3": FamilySpec("smollm3", _common(num_hidden_layers=4, no_rope_layer_interval=4,
                                             tie_word_embeddings=True)),
    # q_norm / k_norm over the whole projection, norms after attention and MLP.
    "olmo2": FamilySpec("olmo2", _common(tie_word_embeddings=False)),
}


def family_names() -> list[str]:
    """Every family tiny_family_checkpoint builds."""
    return list(FAMILIES)


def spec_digest(family: str, seed: int, num_layers: int | None) -> str:
    """16 hex digits naming one checkpoint: its spec, seed, tokenizer and transformers."""
    import transformers

    spec = FAMILIES[family]
    payload = json.dumps({"spec": _spec_json(spec), "seed": seed, "layers": num_layers,
                          "transformers": transformers.__version__,
                          "tokenizer": tokenizer_identity(spec.tokenizer)},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _spec_json(spec: FamilySpec) -> dict[str, Any]:
    return {"model_type": spec.model_type, "config": spec.config, "tokenizer": spec.tokenizer,
            "weight_std": spec.weight_std, "embed_std": spec.embed_std,
            "final_norm_gain": spec.final_norm_gain}


def families_cache() -> Path:
    """Where checkpoints (and their GGUF conversions) live: $PLAIT_CACHE/test-families."""
    return cache_root() / "test-families"


def tiny_family_checkpoint(family: str, *, seed: int = 0, num_layers: int | None = None,
                           cache_dir: Path | None = None) -> Path:
    """The directory of `family`'s tiny checkpoint, written on first use and reused after.

    `num_layers` overrides the spec's layer count. Raises KeyError for an unknown family.
    The same (family, seed, num_layers) always gives bit-identical weights."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; expected one of {family_names()}")
    root = cache_dir if cache_dir is not None else families_cache()
    target = root / f"{family}-{spec_digest(family, seed, num_layers)}"
    return build_once(target, lambda out: _write_checkpoint(family, out, seed, num_layers, root))


def build_config(family: str, num_layers: int | None = None):
    """The transformers config of `family`'s tiny checkpoint (not saved anywhere)."""
    from transformers import AutoConfig

    spec = FAMILIES[family]
    kwargs = copy.deepcopy(spec.config)  # config classes may edit nested dicts in place
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(spec.model_type, **kwargs)


def _write_checkpoint(family: str, out_dir: Path, seed: int, num_layers: int | None,
                      cache: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = FAMILIES[family]
    config = build_config(family, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_weights(model, spec, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(spec.tokenizer, out_dir, cache)


def _redraw_weights(model, spec: FamilySpec, seed: int) -> None:
    """Every matrix ~ N(0, weight_std) (the token embedding N(0, embed_std) when set); every
    vector (norm weights, biases) its init plus N(0, 0.1), so a norm whose weight the
    converter shifts (Gemma's 1 + w) is tested on values != 0."""
    gen = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param is embed and spec.embed_std is not None:
                param.copy_(noise * spec.embed_std)
            elif param.dim() > 1:
                param.copy_(noise * spec.weight_std)
            else:
                param.add_(noise * 0.1)
        offset = 1.0 if spec.model_type.startswith("gemma") else 0.0
        norm = model.model.norm.weight
        norm.copy_((norm + offset) * spec.final_norm_gain - offset)


__all__ = ["FAMILIES", "FamilySpec", "build_config", "families_cache", "family_names",
           "spec_digest", "tiny_family_checkpoint"]
