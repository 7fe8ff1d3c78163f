"""Load Hugging Face safetensors weights into Plait's fused decoder modules.

q/k/v and gate/up are fused from their separate tensors, or read as they are where the
checkpoint stores them fused (Phi-3's `qkv_proj` and `gate_up_proj`). Gemma's norms
(`ModelConfig.norm_offset`) store w for a scale of (1 + w): the 1 is added at load, so
every norm computes x / rms * weight.

With `keep`, a projection or embedding whose tensors the checkpoint stores in bf16 (or f16)
stays so: a one-part BF16 (F16) `QuantWeight` of the raw bytes (lossless; the native
kernels widen it), in a kept `Linear` / `QuantEmbedding`. Everything else, and every weight
without `keep`, is copied into the model's float parameters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from plait.engine.model_config import ModelLoadError
from plait.engine.models.linear import Linear, QuantEmbedding
from plait.engine.models.llama import LlamaForCausalLM, RMSNorm
from plait.kernels.cpu.quant import BF16, F16, QuantPart, QuantWeight

# checkpoint dtypes kept as they are with `keep`: their GGML type
_KEPT_DTYPES = {torch.bfloat16: BF16, torch.float16: F16}

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


def load_weights(model: LlamaForCausalLM, path: Path, keep: bool = False) -> None:
    """Copy every parameter from the checkpoint (with `keep`, bf16/f16 projections and
    embeddings kept as they are: the module docstring); a missing one is a
    `ModelLoadError`."""
    hf = {_plait_name(k): v for k, v in _read_all(path).items()}
    if keep:
        _keep_half(model, hf)
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
    if model.config.norm_offset:
        _add_norm_offset(model)


def _add_norm_offset(model: LlamaForCausalLM) -> None:
    """Every RMS norm's weight w becomes 1 + w (computed in float32, as Gemma's norm)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_((1.0 + module.weight.float()).to(module.weight.dtype))


def _lookup(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    for fused, sources in _FUSED.items():
        if fused in name:
            found = [hf.get(name.replace(fused, src)) for src in sources]
            parts = [p for p in found if p is not None]
            if len(parts) < len(found):
                return hf.get(name)  # stored fused, or missing
            return torch.cat(parts, dim=0)
    return hf.get(name)


def _keep_half(model: LlamaForCausalLM, hf: dict[str, torch.Tensor]) -> None:
    """Swap each Linear / the embedding whose checkpoint tensor is bf16 or f16 for its kept
    module over the raw bytes; the LM head of a tied model shares the embedding's."""
    embedding = hf.get("embed_tokens.weight")
    if embedding is not None and embedding.dtype in _KEPT_DTYPES:
        model.embed_tokens = QuantEmbedding(_half_weight(embedding))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, Linear) or child.qweight is not None:
                continue
            full = next(n for n, m in model.named_modules() if m is child)
            weight = _lookup(hf, f"{full}.weight")
            if full == "lm_head" and weight is None and \
                    isinstance(model.embed_tokens, QuantEmbedding):
                setattr(module, name, Linear.kept(model.embed_tokens.blocks))
            elif weight is not None and weight.dtype in _KEPT_DTYPES:
                bias = _lookup(hf, f"{full}.bias") if child.bias is not None else None
                if child.bias is not None and bias is None:
                    raise ModelLoadError(f"checkpoint lacks weight {full + '.bias'!r}")
                setattr(module, name, Linear.kept(_half_weight(weight), bias))


def _half_weight(tensor: torch.Tensor) -> QuantWeight:  # tensor: [N, K] bf16 or f16
    """A one-part QuantWeight over the tensor's bytes (a GGML bf16/f16 row is K halves)."""
    data = tensor.contiguous().view(torch.uint8)  # [N, 2 K]
    return QuantWeight.build([QuantPart(data, _KEPT_DTYPES[tensor.dtype], tensor.shape[0])],
                             tensor.shape[1])
