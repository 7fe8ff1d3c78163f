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

Tokenizers: the SmolLM2 tokenizer (49,152 tokens), read from the embedded default model's
GGUF, which llama.cpp's converter recognises by its pre-tokenizer hash as `smollm`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.engine.model_loader import cache_root, default_gguf_path

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


def _common(**over: Any) -> dict[str, Any]:
    """The shared tiny shape: hidden 256, 4 query heads of 64, 2 KV heads, 2 layers."""
    base: dict[str, Any] = dict(
        vocab_size=SMOLLM2_VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=None)
    base.update(over)
    return base


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", _common(tie_word_embeddings=True)),
    "qwen2": FamilySpec("qwen2", _common(tie_word_embeddings=False)),
    # head_dim 64 with 8 query heads: q_proj is 256 -> 512, so head_dim != hidden / heads
    # (qwen3.attention.key_length must come from head_dim).
    "qwen3": FamilySpec("qwen3", _common(num_hidden_layers=3, num_attention_heads=8,
                                         head_dim=64, tie_word_embeddings=True)),
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
                          "tokenizer": _tokenizer_identity(spec.tokenizer)},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _spec_json(spec: FamilySpec) -> dict[str, Any]:
    return {"model_type": spec.model_type, "config": spec.config, "tokenizer": spec.tokenizer,
            "weight_std": spec.weight_std}


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
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=root))
    try:
        _write_checkpoint(FAMILIES[family], staging, seed, num_layers)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_config(family: str, num_layers: int | None = None):
    """The transformers config of `family`'s tiny checkpoint (not saved anywhere)."""
    from transformers import AutoConfig

    spec = FAMILIES[family]
    kwargs = dict(spec.config)
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(spec.model_type, **kwargs)


def _write_checkpoint(spec: FamilySpec, out_dir: Path, seed: int,
                      num_layers: int | None) -> None:
    from transformers import AutoModelForCausalLM

    family = next(name for name, s in FAMILIES.items() if s is spec)
    config = build_config(family, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_weights(model, spec.weight_std, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    _TOKENIZER_WRITERS[spec.tokenizer](out_dir)


def _redraw_weights(model: torch.nn.Module, std: float, seed: int) -> None:
    """Every matrix ~ N(0, std); every vector (norm weights, biases) its init plus N(0, 0.1),
    so a norm whose weight the converter shifts (Gemma's 1 + w) is tested on values != 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() > 1:
                param.copy_(noise * std)
            else:
                param.add_(noise * 0.1)


def _smollm2_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer, read once from the default GGUF with transformers and saved."""
    gguf = default_gguf_path()
    target = families_cache() / f"tokenizer-smollm2-{_file_key(gguf)}"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _file_key(path: Path) -> str:
    """A cheap identity of a large file: its name, size and modification time."""
    st = path.stat()
    return hashlib.sha256(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _tokenizer_identity(kind: str) -> str:
    if kind == "smollm2":
        return _file_key(default_gguf_path())
    return kind


def _copy_smollm2_tokenizer(out_dir: Path) -> None:
    source = _smollm2_tokenizer_dir()
    for item in source.iterdir():
        shutil.copy(item, out_dir / item.name)


_TOKENIZER_WRITERS: dict[str, Callable[[Path], None]] = {
    "smollm2": _copy_smollm2_tokenizer,
}

__all__ = ["FAMILIES", "FamilySpec", "build_config", "families_cache", "family_names",
           "spec_digest", "tiny_family_checkpoint"]
