"""Load a GGUF file's tensors straight into Plait's model, each kept in the file's format
(or, with `keep=False`, every tensor dequantized to float32: the families whose GGUF is
not converted to safetensors by transformers, model_loader.py).

The file is memory-mapped (`gguf_file.read_gguf`) and each tensor's bytes copied once into a
`QuantPart`, but the token embeddings', which stay file-backed in a mapping of their own
(`gguf_file.map_tensor`: resident only as far as their rows are read); a type the native
kernels do not take (`KEPT_TYPES`) is dequantized at load, with a log line. GGUF names map
onto Plait's fused modules:

    token_embd                      -> embed_tokens (QuantEmbedding)
    blk.N.attn_q | attn_k | attn_v  -> layers.N.self_attn.qkv_proj, three parts in that order
                                       (their types may differ), biases concatenated;
                                       or blk.N.attn_qkv, fused in the file (phi3)
    blk.N.attn_output               -> layers.N.self_attn.o_proj
    blk.N.ffn_gate | ffn_up         -> layers.N.mlp.gate_up_proj, two parts; or ffn_up alone
                                       holding gate | up (phi3)
    blk.N.ffn_down                  -> layers.N.mlp.down_proj
    output (absent: tied)           -> lm_head (a tied head shares token_embd's QuantWeight)
    blk.N.attn_norm | post_attention_norm | ffn_norm | post_ffw_norm
                                    -> the layer's norms by role (models/layers.py NORMS)
    blk.N.attn_q_norm | attn_k_norm -> layers.N.self_attn.q_norm | k_norm
    *_norm, biases                  -> float32 parameters

llama.cpp's converter permutes the rows of attn_q / attn_k in the files of the families whose
llama.cpp RoPE type is NORM (`PERMUTED`: llama, granite, smollm3; the interleaved RoPE
layout GGML computes in); Plait rotates halves as Hugging Face does, so the rows are
put back, per head, as transformers' GGUF loader does (`_reverse_permute_weights`):

    file row  h * 2d + 2i + j   ->   row  h * 2d + j * d + i      (d = head_dim / 2, j < 2)

GGML rows are independent, so this reorders row bytes. The NEOX families (qwen2, qwen3,
gemma2, gemma3, phi3, olmo2) are not permuted.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from plait.engine.gguf_file import GgufTensor, map_tensor, read_gguf
from plait.engine.model_config import ModelLoadError
from plait.engine.models.linear import Linear, QuantEmbedding
from plait.engine.models.llama import LlamaForCausalLM
from plait.kernels.cpu.quant import (
    KEPT_TYPES,
    QuantPart,
    QuantWeight,
    dequantize_reference,
    type_name,
)

logger = logging.getLogger("plait.engine")

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# GGUF tensors Plait does not read: llama3's RoPE factors (computed from the config), phi3's
# longrope factors (read into the config at conversion, gguf_config.py).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# architectures whose q / k rows the converter permutes (llama.cpp's LLAMA_ROPE_TYPE_NORM)
PERMUTED = ("llama", "granite", "smollm3")
# a layer's norm tensors by role (models/layers.py: ATTN_IN, ATTN_OUT, FFN_IN, FFN_OUT)
_NORM_TENSORS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
Piece = QuantPart | torch.Tensor  # a kept part, or rows dequantized to float32 [rows, K]


def load_gguf_weights(model: LlamaForCausalLM, path: Path, keep: bool = True) -> None:
    """Replace `model`'s embedding, linear layers and norms with the file's tensors:
    kept `Linear`s / `QuantEmbedding` where every piece is a kept type (and `keep`), float32
    modules otherwise. Raises `ModelLoadError` for a missing or misshapen tensor."""
    try:
        file = read_gguf(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    tensors = file.tensors
    loader = _Loader(tensors, model, file.architecture in PERMUTED, path, keep)
    loader.load()
    unused = sorted(set(tensors) - loader.used - set(_IGNORED))
    if unused:
        logger.warning("%s: tensors not loaded: %s", path.name, ", ".join(unused))


class _Loader:
    """One pass over a model's modules, reading each from the file's tensors by name."""

    def __init__(self, tensors: dict[str, GgufTensor], model: LlamaForCausalLM, permuted: bool,
                 path: Path, keep: bool = True) -> None:
        self.tensors, self.model, self.permuted = tensors, model, permuted
        self.path, self.keep = path, keep
        self.used: set[str] = set()

    def load(self) -> None:
        cfg, model = self.model.config, self.model
        for i, layer in enumerate(model.decoder_layers()):
            attn, mlp = layer.self_attn, layer.mlp
            if f"blk.{i}.attn_qkv.weight" in self.tensors:  # fused in the file (phi3)
                attn.qkv_proj = self.linear(attn.qkv_proj, [f"blk.{i}.attn_qkv"])
            else:
                heads = (cfg.num_heads, cfg.num_kv_heads, None)
                names = [f"blk.{i}.attn_{p}" for p in "qkv"]
                attn.qkv_proj = self.linear(attn.qkv_proj, names, heads)
            attn.o_proj = self.linear(attn.o_proj, [f"blk.{i}.attn_output"])
            gate_up = [f"blk.{i}.ffn_gate", f"blk.{i}.ffn_up"]
            if f"blk.{i}.ffn_gate.weight" not in self.tensors:  # ffn_up holds gate | up
                gate_up = gate_up[1:]
            mlp.gate_up_proj = self.linear(mlp.gate_up_proj, gate_up)
            mlp.down_proj = self.linear(mlp.down_proj, [f"blk.{i}.ffn_down"])
            for role, name in enumerate(_NORM_TENSORS):
                norm = layer.norm(role)
                if norm is not None:
                    self.norm(norm.weight, f"blk.{i}.{name}.weight")
            if attn.qk_norm is not None:
                self.norm(attn.q_norm.weight, f"blk.{i}.attn_q_norm.weight")
                self.norm(attn.k_norm.weight, f"blk.{i}.attn_k_norm.weight")
        self.norm(model.norm.weight, "output_norm.weight")
        embedding = self.embedding("token_embd.weight", cfg.vocab_size, cfg.hidden_size)
        model.embed_tokens = embedding
        if "output.weight" in self.tensors:
            model.lm_head = self.linear(model.lm_head, ["output"])
        elif isinstance(embedding, QuantEmbedding):
            model.lm_head = Linear.kept(embedding.blocks)
        else:  # a float32 embedding: the head shares its Parameter
            model.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            model.lm_head.weight = embedding.weight

    def linear(self, empty: Linear, names: list[str],
               heads: tuple[int | None, ...] | None = None) -> Linear:
        """The projection `empty` (the model's placeholder, for its shape and bias) fused
        from tensors `names` (+ ".weight"), rows of part i un-permuted over heads[i] heads
        where the file is permuted."""
        heads = heads or (None,) * len(names)
        pieces = [self.piece(f"{n}.weight", h) for n, h in zip(names, heads, strict=True)]
        in_features = int(self.tensors[f"{names[0]}.weight"].shape[0])
        rows = sum(p.rows if isinstance(p, QuantPart) else p.shape[0] for p in pieces)
        if (rows, in_features) != (empty.out_features, empty.in_features):
            raise ModelLoadError(f"{self.path.name}: {'|'.join(names)} is [{rows}, "
                                 f"{in_features}], expected [{empty.out_features}, "
                                 f"{empty.in_features}]")
        bias_t = None if empty.bias is None else torch.cat(
            [self.dense(f"{n}.bias", h) for n, h in zip(names, heads, strict=True)])
        quant = [p for p in pieces if isinstance(p, QuantPart)]
        if len(quant) == len(pieces):
            weight = QuantWeight.build(quant, in_features)
            return Linear.kept(weight, bias_t)
        dense = [p if isinstance(p, torch.Tensor)
                 else dequantize_reference(QuantWeight.build([p], in_features))
                 for p in pieces]
        return _dense_linear(torch.cat(dense), bias_t)

    def embedding(self, name: str, vocab_size: int,
                  hidden_size: int) -> nn.Embedding | QuantEmbedding:
        shape = tuple(self.tensor(name).shape)
        if shape != (hidden_size, vocab_size):  # GGUF order: [K, rows]
            raise ModelLoadError(f"{self.path.name}: {name} is {list(reversed(shape))}, "
                                 f"expected [{vocab_size}, {hidden_size}]")
        piece = self.piece(name, mapped=True)
        if isinstance(piece, QuantPart):
            in_features = int(self.tensors[name].shape[0])
            return QuantEmbedding(QuantWeight.build([piece], in_features))
        embedding = nn.Embedding(*piece.shape)
        with torch.no_grad():
            embedding.weight.copy_(piece)
        return embedding

    def norm(self, param: nn.Parameter, name: str) -> None:
        values = self.dense(name)
        if values.shape != param.shape:
            raise ModelLoadError(f"{self.path.name}: {name} has shape {tuple(values.shape)}, "
                                 f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(values)

    def tensor(self, name: str) -> GgufTensor:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path.name} lacks tensor {name!r}")
        self.used.add(name)
        return self.tensors[name]

    def piece(self, name: str, heads: int | None = None, mapped: bool = False) -> Piece:
        """Tensor `name` as a kept `QuantPart`, or dequantized to float32 [rows, K]. A kept
        part's bytes are copied out of the file, or with `mapped` (the token embeddings,
        read a few rows a step) left in a mapping of their own (`map_tensor`)."""
        t = self.tensor(name)
        ggml_type, in_features = int(t.tensor_type), int(t.shape[0])
        rows = int(np.prod(t.shape[1:]))
        order = _unpermute(rows, heads) if self.permuted and heads else None
        if ggml_type in KEPT_TYPES and self.keep:
            raw = map_tensor(self.path, t) if mapped and order is None else np.array(t.data)
            data = torch.from_numpy(raw.view(np.uint8).reshape(rows, -1))
            data = data if order is None else data[order].contiguous()
            return QuantPart(data, ggml_type, rows)
        if self.keep:
            logger.info("%s: %s is %s, dequantized to float32 at load", self.path.name,
                        name, type_name(ggml_type))
        return self.dense(name, heads).reshape(rows, in_features)

    def dense(self, name: str, heads: int | None = None) -> torch.Tensor:
        """Tensor `name` dequantized to float32 in its torch shape (rows un-permuted)."""
        t = self.tensor(name)
        array = gguf_dequantize(np.asarray(t.data), GGMLQuantizationType(int(t.tensor_type)))
        values = torch.from_numpy(np.array(array, dtype=np.float32))
        if self.permuted and heads:
            values = values[_unpermute(values.shape[0], heads)].contiguous()
        return values


def _unpermute(rows: int, heads: int) -> torch.Tensor:  # [rows] int64: file row per row
    """The file row holding each Hugging Face row of a permuted q or k (module docstring)."""
    if rows % (2 * heads):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {heads} heads")
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A float32 `Linear` over `weight` [out, in] (select_products gives it its row)."""
    linear = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    assert linear.weight is not None
    with torch.no_grad():
        linear.weight.copy_(weight)
        if linear.bias is not None and bias is not None:
            linear.bias.copy_(bias)
    return linear


__all__ = ["load_gguf_weights"]
