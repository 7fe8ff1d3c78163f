"""Load Hugging Face safetensors weights into Plait's fused Llama modules."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from plait.engine.model_config import ModelLoadError
from plait.engine.models.llama import LlamaForCausalLM

# HF name fragments that Plait stores fused: target -> (sources in concatenation order)
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                    tensors[name] = fh.get_tensor(name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read weights in {path}: {exc}") from None
    return tensors


def _plait_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    """Copy every parameter from the checkpoint; a missing one is a `ModelLoadError`."""
    hf = {_plait_name(k): v for k, v in _read_all(path).items()}
    params = dict(model.named_parameters())
    for name, param in params.items():
        tensor = _lookup(hf, name)
        if tensor is None and name == "lm_head.weight":
            tensor = hf.get("embed_tokens.weight")  # tied embeddings
        if tensor is None:
            raise ModelLoadError(f"checkpoint in {path} lacks weight {name!r}")
        if tensor.shape != param.shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))


def _lookup(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    for fused, sources in _FUSED.items():
        if fused in name:
            parts = [hf.get(name.replace(fused, src)) for src in sources]
            if any(p is None for p in parts):
                return None
            return torch.cat(parts, dim=0)  # type: ignore[arg-type]
    return hf.get(name)
