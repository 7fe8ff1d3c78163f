"""The architecture facts Plait's model needs, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class ModelLoadError(Exception):
    """A model cannot be loaded; the message is one line meant for the user."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Llama-family hyper-parameters. `rope_scaling` is the llama3 dict or None."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (HF directory) or a Llama-family .gguf")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        # transformers >= 5 nests RoPE settings under `rope_parameters`.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 has q/k/v biases and no flag for them; Llama exposes `attention_bias`.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model "
                                 "directory or a .gguf file")
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {config_file}: {exc}") from None
        return cls.from_dict(raw)
