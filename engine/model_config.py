"""The architecture facts Plait's model needs, read from a Hugging Face `config.json`.

One `ModelConfig` describes every supported family: the Llama shape (llama, mistral,
qwen2) with each field at its default, and per-family variants as declared fields (q/k
norms, norm layout, activation, multipliers, softcaps, sliding windows, partial or
per-layer RoPE). What each family's `config.json` keys mean is `engine/hf_families.py`;
a GGUF's keys are translated into such a `config.json` by `engine/gguf_config.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# model_type values of config.json (a GGUF's general.architecture maps onto them)
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text",
                           "phi3", "granite", "smollm3", "olmo2")
QK_NORMS = (None, "head", "proj")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")  # models/rope.py computes each
NORM_LAYOUTS = ("pre", "sandwich", "post")
ACTIVATIONS = ("silu", "gelu_tanh")


class ModelLoadError(Exception):
    """A model cannot be loaded; the message is one line meant for the user."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Decoder hyper-parameters. `rope_scaling` is None (plain RoPE) or a dict whose
    "rope_type" is one of rope.SCALINGS, with that type's keys (models/rope.py).

    The fields after `eos_token_ids` are the family variants; their defaults are the Llama
    shape, which alone the native whole-stack kernel runs (`is_plain`):

        qk_norm            None; "head": RMS norm of each q / k head over head_dim (qwen3,
                           gemma3); "proj": over the whole q / k projection (olmo2)
        norm_layout        "pre": a norm before attention and before the MLP; "sandwich":
                           also one on each sublayer's output before the residual add
                           (gemma); "post": only those output norms (olmo2)
        norm_offset        the checkpoint stores Gemma's norm weights w for (1 + w): the HF
                           loader adds the 1 (a GGUF's norms already hold it)
        hidden_act         "silu" or "gelu_tanh" on the gate (gemma)
        embedding_scale    embeddings times this (gemma: sqrt(hidden); granite)
        residual_scale     each sublayer's output times this before the add (granite)
        attention_scale    the scale of q.k; None: head_dim ** -0.5
        logits_divisor     logits divided by this (granite's logits_scaling)
        attn_softcap       > 0: cap * tanh(s / cap) on the scaled attention logits (gemma2)
        final_softcap      > 0: the same on the output logits (gemma2, gemma3)
        rotary_dim         the leading dims of each head RoPE rotates; None: all (phi3)
        sliding_window     the window of the layers in `sliding_layers`: a query at p
                           attends keys k with p - k < window
        sliding_layers     indices of the windowed layers
        nope_layers        indices of the layers without RoPE (smollm3)
        local_rope_theta   the windowed layers' own RoPE base, unscaled (gemma3); None:
                           they use `rope_theta` and `rope_scaling` as the others
    """

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
    qk_norm: str | None = None
    norm_layout: str = "pre"
    norm_offset: bool = False
    hidden_act: str = "silu"
    embedding_scale: float | None = None
    residual_scale: float | None = None
    attention_scale: float | None = None
    logits_divisor: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    rotary_dim: int | None = None
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS or self.norm_layout not in NORM_LAYOUTS \
                or self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"{self.model_type}: unsupported variant (qk_norm "
                                 f"{self.qk_norm!r}, norm_layout {self.norm_layout!r}, "
                                 f"hidden_act {self.hidden_act!r})")
        rotary = self.rotary_dim
        if rotary is not None and not (0 < rotary <= self.head_dim and rotary % 2 == 0):
            raise ModelLoadError(f"{self.model_type}: rotary_dim {rotary} must be even and "
                                 f"in (0, head_dim {self.head_dim}]")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "longrope":
            half = (rotary or self.head_dim) // 2
            for key in ("short_factor", "long_factor"):
                if len(scaling[key]) != half:
                    raise ModelLoadError(f"{self.model_type}: longrope {key} has "
                                         f"{len(scaling[key])} values, expected {half}")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ModelLoadError(f"{self.model_type}: sliding layers need a sliding_window")

    @property
    def is_plain(self) -> bool:
        """Whether this is the Llama shape (every variant field at its default)."""
        return (self.qk_norm is None and self.norm_layout == "pre" and not self.norm_offset
                and self.hidden_act == "silu" and self.embedding_scale is None
                and self.residual_scale is None and self.attention_scale is None
                and self.logits_divisor is None and not self.attn_softcap
                and not self.final_softcap and self.rotary_dim in (None, self.head_dim)
                and not self.sliding_layers and not self.nope_layers
                and self.local_rope_theta is None)

    def window_of(self, layer_idx: int) -> int:
        """Layer `layer_idx`'s attention window (0: the whole context)."""
        return self.sliding_window if layer_idx in self.sliding_layers else 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """The config of a Hugging Face `config.json` (ModelLoadError: unsupported)."""
        from plait.engine.hf_families import config_from_hf

        return config_from_hf(raw)

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
