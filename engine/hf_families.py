"""What each supported family's Hugging Face `config.json` means: one function per family
turning its keys into `ModelConfig`'s variant fields (model_config.py lists them).

    config_from_hf(raw)   the fields every family shares (+ RoPE), then FAMILIES[type]'s

The raw JSON is read without transformers (the HTTP process of `plait serve` resolves the
model and stays torch-free), so defaults that transformers' config classes fill in are
restated here, each from that class: Gemma's sliding pattern, SmolLM3's NoPE interval,
the RoPE bases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from plait.engine.model_config import (
    ROPE_SCALINGS,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
)

Raw = dict[str, Any]

# config classes' default RoPE bases where config.json may omit them
_DEFAULT_THETA = {"gemma3_text": 1_000_000.0, "smollm3": 2_000_000.0}
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_PATTERN = 6  # one full-attention layer every 6th (Gemma3TextConfig)
_SMOLLM3_NOPE_INTERVAL = 4  # every 4th layer without RoPE (SmolLM3Config)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(raw: Raw) -> ModelConfig:
    """The `ModelConfig` of a `config.json`; ModelLoadError names an unsupported
    architecture, RoPE type or activation, or a missing key."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (HF directory or .gguf)")
    try:
        return ModelConfig(**_common(raw, model_type), **FAMILIES[model_type](raw))
    except KeyError as exc:
        raise ModelLoadError(f"{model_type} config.json lacks {exc}") from None


def _common(raw: Raw, model_type: str) -> Raw:
    num_heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // num_heads
    params = _rope_parameters(raw)[0]
    theta = raw.get("rope_theta") or params.get("rope_theta") \
        or _DEFAULT_THETA.get(model_type, 10000.0)
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    eos = raw.get("eos_token_id")
    max_positions = raw.get("max_position_embeddings", 2048)
    return dict(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=_scaling(raw, params, model_type, max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        # Qwen2 has q/k/v biases and no flag for them; the others expose `attention_bias`.
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
    )


def _rope_parameters(raw: Raw) -> tuple[Raw, float | None]:
    """The global layers' RoPE dict, and the local layers' base where the config gives
    them their own (transformers >= 5 nests RoPE under `rope_parameters`, keyed by layer
    type for Gemma 3; older files have `rope_scaling` and `rope_local_base_freq`)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"unsupported local rope_type {local['rope_type']!r}; "
                                 "supported: default")
        return params.get("full_attention") or {}, local.get("rope_theta")
    return params, raw.get("rope_local_base_freq")


def _scaling(raw: Raw, params: Raw, model_type: str, max_positions: int) -> Raw | None:
    """The RoPE scaling dict rope.py takes ("rope_type" + that type's keys), or None."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's names for it (Phi3Config does the same)
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALINGS:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: default, "
                             f"{', '.join(ROPE_SCALINGS)}")
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = rope_type
    if rope_type in ("yarn", "longrope"):
        original = scaling.get("original_max_position_embeddings") \
            or raw["original_max_position_embeddings"]
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:  # Phi-3: the ratio of the two lengths
            scaling["factor"] = max_positions / original
    return scaling


def _windows(raw: Raw, default_types: list[str] | None = None) -> Raw:
    """sliding_window / sliding_layers from `layer_types` (or `default_types`), unless the
    config turns windows off (`use_sliding_window` false or no `sliding_window`)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types") or default_types or []
    if not window or raw.get("use_sliding_window", True) is False:
        return {}
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {"sliding_window": int(window), "sliding_layers": sliding} if sliding else {}


def _activation(raw: Raw) -> str:
    name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"unsupported activation {name!r}; supported: "
                             f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _llama(raw: Raw) -> Raw:
    return {}


def _qwen3(raw: Raw) -> Raw:
    return {"qk_norm": "head", **_windows(raw)}


def _gemma(raw: Raw, default_types: list[str]) -> Raw:
    """What Gemma 2 and 3 share: sandwich norms of (1 + w), gated GELU-tanh, embeddings
    times sqrt(hidden), q.k scaled by query_pre_attn_scalar ** -0.5, softcaps."""
    return {"norm_layout": "sandwich", "norm_offset": True, "hidden_act": _activation(raw),
            "embedding_scale": math.sqrt(raw["hidden_size"]),
            "attention_scale": raw.get("query_pre_attn_scalar", 256) ** -0.5,
            "attn_softcap": float(raw.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(raw.get("final_logit_softcapping") or 0.0),
            **_windows(raw, default_types)}


def _gemma2(raw: Raw) -> Raw:
    layers = range(raw["num_hidden_layers"])
    return _gemma(raw, ["sliding_attention" if (i + 1) % 2 else "full_attention"
                        for i in layers])


def _gemma3(raw: Raw) -> Raw:
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") \
        or _GEMMA3_PATTERN
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
             for i in range(raw["num_hidden_layers"])]
    fields = _gemma(raw, types)
    fields["qk_norm"] = "head"
    fields["local_rope_theta"] = float(_rope_parameters(raw)[1] or _GEMMA3_LOCAL_THETA)
    return fields


def _phi3(raw: Raw) -> Raw:
    window = raw.get("sliding_window")  # Phi3Attention windows every layer
    if not window:
        return {}
    return {"sliding_window": int(window), "sliding_layers": tuple(range(
        raw["num_hidden_layers"]))}


def _granite(raw: Raw) -> Raw:
    return {"embedding_scale": float(raw.get("embedding_multiplier", 1.0)),
            "residual_scale": float(raw.get("residual_multiplier", 1.0)),
            "attention_scale": float(raw.get("attention_multiplier", 1.0)),
            "logits_divisor": float(raw.get("logits_scaling", 1.0))}


def _smollm3(raw: Raw) -> Raw:
    num_layers = raw["num_hidden_layers"]
    uses_rope = raw.get("no_rope_layers") or [
        int((i + 1) % _SMOLLM3_NOPE_INTERVAL != 0) for i in range(num_layers)]
    return {"nope_layers": tuple(i for i, r in enumerate(uses_rope) if not r),
            **_windows(raw)}


def _olmo2(raw: Raw) -> Raw:
    return {"qk_norm": "proj", "norm_layout": "post"}


FAMILIES: dict[str, Callable[[Raw], Raw]] = {
    "llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _qwen3,
    "gemma2": _gemma2, "gemma3_text": _gemma3, "phi3": _phi3, "granite": _granite,
    "smollm3": _smollm3, "olmo2": _olmo2,
}
assert tuple(FAMILIES) == SUPPORTED_ARCHITECTURES
