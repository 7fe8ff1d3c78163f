"""transformers' model of a family on the weights of a GGUF converted from its tiny checkpoint:
the reference for parity tests of the engine on that GGUF, quantized ones included.

    reference_model("gemma3", family_gguf("gemma3", "q8_0"))  -> Gemma3ForCausalLM, float32

transformers' own GGUF loader (helpers/model.transformers_on_gguf) cannot be that reference
for these families: it has no granite, smollm3 or olmo2; it builds qwen3 with head_dim =
hidden / heads (ignoring qwen3.attention.key_length) and fails to load it; it gives phi3 a
pad_token_id of 32000 past a 1,024-token vocabulary and fails; and it builds the Gemmas with
the default query_pre_attn_scalar (256), so their logits differ from the checkpoint's.

So this builds the model from the checkpoint's own config.json and loads every tensor of the
GGUF, dequantized by gguf-py and with the converter's edits undone: gemma norms (every
`*norm.weight`) less 1, and for the LlamaModel converters (PERMUTED_QK) q/k rows put back
from llama.cpp's interleaved rope order. A tied output head (no output.weight) is re-tied.
On an F32 GGUF the result equals the checkpoint bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from plait.engine.gguf_file import read_gguf

# Families whose converter (a LlamaModel) permutes q_proj / k_proj rows for llama.cpp's rope.
PERMUTED_QK = frozenset({"llama", "granite", "smollm3"})
# Families whose converter writes RMSNorm weights as 1 + w.
NORM_SHIFTED = frozenset({"gemma2", "gemma3"})


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's LlamaModel.permute: per head, rows [x0, y0, x1, y1, ...] back to
    transformers' [x0, x1, ..., y0, y1, ...]. weight: [num_heads * head_dim, K]."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_state_dict(family: str, gguf_path: Path, model: torch.nn.Module,
                    ) -> dict[str, torch.Tensor]:
    """The GGUF's tensors as `model`'s (transformers) parameters, float32, converter edits
    undone. Tensors the GGUF lacks (a tied lm_head) are left out."""
    import gguf

    cfg = model.config
    arch = gguf.MODEL_ARCH[family.upper()]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    tensors = read_gguf(gguf_path).tensors
    state: dict[str, torch.Tensor] = {}
    for hf_name, param in model.state_dict().items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None or gguf_name not in tensors:
            continue
        tensor = tensors[gguf_name]
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        values = values.reshape(param.shape).astype(np.float32)
        if family in NORM_SHIFTED and hf_name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        if family in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            values = unpermute_qk(values, heads)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    return state


def reference_model(family: str, gguf_path: Path, checkpoint: Path | None = None):
    """transformers' model of `family` (the config of `checkpoint`, default the family's tiny
    checkpoint) carrying the weights of `gguf_path`, in float32 and eval mode. Raises
    ValueError when the GGUF misses a parameter other than a tied lm_head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import tiny_family_checkpoint

    path = checkpoint if checkpoint is not None else tiny_family_checkpoint(family)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_state_dict(family, gguf_path, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_path}: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
