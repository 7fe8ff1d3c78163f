"""Tiny random-weight Llama-family checkpoints for fast engine tests.

They reuse the default model's tokenizer (so text round-trips), with a few small layers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def make_tiny_model(out_dir: Path, tokenizer_dir: Path, model_type: str = "llama",
                    rope_scaling: dict | None = None, seed: int = 0,
                    vocab_size: int = 49152) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a random tiny model
    (`vocab_size` rows of embedding: the tokenizer's 49152 unless a test wants another)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=model_type == "llama",
                  eos_token_id=2, bos_token_id=1)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
        kwargs["rope_theta"] = 500000.0
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # larger weights than the default init: peaky, seed-sensitive logits
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
            elif model_type == "qwen2":
                param.normal_(0.0, 0.5)
    return save_checkpoint(model, out_dir, tokenizer_dir)


def save_checkpoint(model, out_dir: Path, tokenizer_dir: Path) -> Path:
    """`model`'s config.json and model.safetensors in `out_dir`, with the tokenizer files of
    `tokenizer_dir` (the default model's) copied beside them; returns `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
