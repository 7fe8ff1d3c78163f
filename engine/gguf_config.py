"""A GGUF file's hyper-parameters as the `config.json` Hugging Face would write, read from
the file's own keys as llama.cpp reads them (not through transformers' GGUF-to-config
mapping, which drops `{arch}.attention.key_length`, the RoPE scalings and more).

    hf_config_from_gguf(file) -> dict    then ModelConfig.from_dict (hf_families.py)

Where llama.cpp derives a value instead of reading a key, so does this, the same way:

    gemma2 / gemma3  q.k scale 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for the 27B
                     models (46 / 62 layers): llama.cpp's rule, since the converter drops
                     query_pre_attn_scalar; windowed layers per `sliding_window_pattern`
                     (2 for gemma2, 6 for gemma3 unless the file says), their RoPE base
                     `rope.freq_base_swa` (default 10000), unscaled
    phi3             longrope when the file holds rope_factors_long / rope_factors_short
                     (their values become the factor lists), its attention factor
                     `rope.scaling.attn_factor`; a sliding window of 0 is none. A window
                     > 0 (Phi-3-mini's 2047) windows every layer as transformers does;
                     llama.cpp currently ignores it (its "Phi SWA is disabled" warning),
                     so the two differ past that many positions
    smollm3          every 4th layer without RoPE (llama.cpp's fixed step)

The norms of a Gemma GGUF already hold Gemma's + 1; the GGUF loader copies them as they
are (gguf_weights.py), the safetensors loader adds it (weights.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from plait.engine.model_config import ModelLoadError

if TYPE_CHECKING:  # (numpy and gguf stay out of the torch-free server process's imports)
    import numpy as np

    from plait.engine.gguf_file import GgufFile

# general.architecture -> config.json model_type, for the families this file translates
GGUF_MODEL_TYPES = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
                    "phi3": "phi3", "granite": "granite", "smollm3": "smollm3",
                    "olmo2": "olmo2"}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_SCALING_TYPES = ("linear", "yarn")  # rope.scaling.type values besides none / longrope


class _Keys:
    """The file's `{arch}.*` keys, read with defaults or required."""

    def __init__(self, file: GgufFile) -> None:
        self.arch, self.meta = file.architecture, file.metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def one(self, key: str, default: Any = None) -> Any:
        """The key's value; a per-layer array must hold one value for every layer."""
        value = self.get(key, default)
        if isinstance(value, tuple):
            if len(set(value)) != 1:
                raise ModelLoadError(f"GGUF {self.arch}.{key} differs between layers "
                                     "(unsupported)")
            value = value[0]
        return value

    def need(self, key: str) -> Any:
        value = self.one(key)
        if value is None:
            raise ModelLoadError(f"GGUF file lacks {self.arch}.{key}")
        return value


def hf_config_from_gguf(file: GgufFile) -> dict[str, Any]:
    """The `config.json` dict of `file` (ModelLoadError: an architecture not in
    GGUF_MODEL_TYPES or a missing key)."""
    arch = file.architecture
    if arch not in GGUF_MODEL_TYPES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}")
    keys = _Keys(file)
    config = _common(file, keys)
    config.update(_FAMILY[arch](file, keys, config))
    return config


def _common(file: GgufFile, keys: _Keys) -> dict[str, Any]:
    hidden, heads = keys.need("embedding_length"), keys.need("attention.head_count")
    head_dim = keys.one("attention.key_length") or hidden // heads
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError("GGUF file lacks tensor 'token_embd.weight'")
    meta = file.metadata
    config: dict[str, Any] = {
        "model_type": GGUF_MODEL_TYPES[file.architecture],
        "vocab_size": int(embedding.shape[1]),  # GGUF order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": keys.need("feed_forward_length"),
        "num_hidden_layers": keys.need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": keys.one("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": keys.get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": keys.get("rope.freq_base", 10000.0),
        "max_position_embeddings": keys.get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    rotary = keys.get("rope.dimension_count")
    if rotary and rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    scaling = _rope_scaling(keys)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(keys: _Keys) -> dict[str, Any] | None:
    kind = keys.get("rope.scaling.type", "none")
    factor = keys.get("rope.scaling.factor")
    if kind in ("none", "longrope") or not factor or factor == 1.0:
        return None  # longrope: from the factor tensors (phi3)
    if kind not in _SCALING_TYPES:
        raise ModelLoadError(f"unsupported GGUF rope.scaling.type {kind!r}; supported: "
                             f"none, {', '.join(_SCALING_TYPES)}, longrope (phi3)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = keys.need(
            "rope.scaling.original_context_length")
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if keys.get(f"rope.scaling.{key}") is not None:
                scaling[name] = keys.get(f"rope.scaling.{key}")
    return scaling


def _nothing(file: GgufFile, keys: _Keys, config: dict[str, Any]) -> dict[str, Any]:
    return {}


def _gemma(file: GgufFile, keys: _Keys, config: dict[str, Any]) -> dict[str, Any]:
    arch, layers = file.architecture, config["num_hidden_layers"]
    pattern = keys.get("attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, tuple):  # llama.cpp's per-layer form: true = windowed
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    window = keys.get("attention.sliding_window") or 0
    big = layers == _GEMMA_27B_LAYERS[arch]
    scalar = config["hidden_size"] / config["num_attention_heads"] if big else config["head_dim"]
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
        "sliding_window": window or None,
        "layer_types": types if window else ["full_attention"] * layers,
        "attn_logit_softcapping": keys.get("attn_logit_softcapping"),
        "final_logit_softcapping": keys.get("final_logit_softcapping")}
    if arch == "gemma3":
        fields["rope_local_base_freq"] = keys.get("rope.freq_base_swa", 10000.0)
    return fields


def _phi3(file: GgufFile, keys: _Keys, config: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"sliding_window": keys.get("attention.sliding_window") or None}
    long, short = (file.tensors.get(f"rope_factors_{s}.weight") for s in ("long", "short"))
    if long is None or short is None:
        return fields
    original = keys.need("rope.scaling.original_context_length")
    factor = config["max_position_embeddings"] / original
    attention = keys.get("rope.scaling.attn_factor")
    fields["rope_scaling"] = {
        "rope_type": "longrope", "original_max_position_embeddings": original,
        "factor": factor, "long_factor": _floats(long.data), "short_factor": _floats(short.data),
        "attention_factor": attention if attention is not None else (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))}
    return fields


def _floats(data: np.ndarray) -> list[float]:
    """A float32 tensor's bytes as Python floats."""
    import numpy as np

    return [float(x) for x in np.asarray(data).view(np.float32)]


def _granite(file: GgufFile, keys: _Keys, config: dict[str, Any]) -> dict[str, Any]:
    return {"embedding_multiplier": keys.get("embedding_scale", 1.0),
            "residual_multiplier": keys.get("residual_scale", 1.0),
            "attention_multiplier": keys.get("attention.scale", config["head_dim"] ** -0.5),
            "logits_scaling": keys.get("logit_scale", 1.0)}


_FAMILY = {"qwen3": _nothing, "gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3,
           "granite": _granite, "smollm3": _nothing, "olmo2": _nothing}
