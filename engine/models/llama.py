"""The decoder of every supported family (Llama, Mistral, Qwen2 and the variants that
model_config.py declares) over a paged KV cache; its parts are layers.py.

One forward call takes a flattened variable-length batch that can mix prefills (with or
without an already-cached prefix) and decodes (`input_ids [T]`, `positions [T]`, and the
step's `AttentionMetadata`, planned by the ops table; see plait.kernels.metadata). Every
operation besides the GEMMs goes through the ops table the model was built with
(plait.kernels.ops); the linear layers run their own weight format (linear.py).

Each layer writes the new K/V into its cache before attention reads it, so a sequence can
attend to blocks another sequence of the same batch is computing in this very call. A
small step of a model of the Llama shape (`ModelConfig.is_plain`) runs every layer in one
native call (kernels/cpu/decoder.c), in the layer loop's order and bits.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from plait.engine.model_config import ModelConfig
from plait.engine.models.layers import (
    ATTN_IN,
    FFN_IN,
    MLP,
    Attention,
    DecoderLayer,
    KVCache,
    RMSNorm,
)
from plait.engine.models.linear import Linear, QuantEmbedding
from plait.engine.models.rope import rope_cos_sin
from plait.kernels import AttentionMetadata, TorchOps
from plait.kernels.cpu.stack import NativeStack, StackLayer, StackShape, gather_stack

__all__ = ["MLP", "Attention", "DecoderLayer", "KVCache", "LlamaForCausalLM", "RMSNorm"]


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head; `forward` returns hidden states, `compute_logits` the logits
    of only the rows that need sampling. `bind` gives it its KV caches once."""

    cos_sin: torch.Tensor  # [max_positions, R] = cos | sin halves (a buffer), R = rotary dims
    cos_sin_local: torch.Tensor | None  # the windowed layers' own table (gemma3), or None
    embed_tokens: nn.Embedding | QuantEmbedding  # the GGUF loader may keep it quantized
    lm_head: Linear

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: TorchOps) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        rotary = cfg.rotary_dim or cfg.head_dim
        self.register_buffer("cos_sin", rope_cos_sin(rotary, max_positions, cfg.rope_theta,
                                                     cfg.rope_scaling), persistent=False)
        local = None if cfg.local_rope_theta is None else \
            rope_cos_sin(rotary, max_positions, cfg.local_rope_theta, None)
        self.register_buffer("cos_sin_local", local, persistent=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_caches: list[KVCache] = []
        self.stack: NativeStack | None = None

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed (an `nn.ModuleList` yields plain modules)."""
        return cast(list[DecoderLayer], list(self.layers))

    def bind(self, kv_caches: list[KVCache]) -> None:
        """Give the model its KV caches (one (k, v) per layer), after its linear layers have
        their final format: each attention derives its key offset for the caches' dtype
        (key_offset.py); where the ops table runs whole stacks, the layers' addresses are
        gathered here, once."""
        self.kv_caches = list(kv_caches)
        for layer, (k_cache, _) in zip(self.decoder_layers(), self.kv_caches, strict=True):
            table = self.cos_sin_local if layer.local_rope else self.cos_sin
            assert table is not None
            layer.self_attn.bind_cache(k_cache.dtype, table)
        self.stack = self._native_stack() if self.ops.stack_rows else None
        if self.stack is not None:
            self.ops.bind_stack(self.stack)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,  # planned by `ops.plan`
    ) -> torch.Tensor:  # [T, hidden], or [K, hidden] (rows `meta.keep`)
        """The final hidden states of every token, or with `meta.keep` of those rows only:
        the last layer then writes every token's K/V but attends and runs its MLP for those
        rows alone (a prefill chunk samples one row of hundreds: ~1/36 of its GEMMs saved).
        A step planned `whole_stack` runs its layers in the native stack; with `meta.keep`,
        all but the last, which runs here, pruned."""
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:  # in x's dtype, as transformers rounds it
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        last = len(self.layers) - 1
        residual, delta, first = x, None, 0
        if meta.whole_stack and self.stack is not None:
            if meta.keep is None or last == 0:
                hidden = self.ops.decoder_stack(self.stack, x, positions, meta)
                return hidden if meta.keep is None else hidden[meta.keep]
            delta, first = self.ops.decoder_stack(self.stack, x, positions, meta, last), last
        layers = list(zip(self.decoder_layers(), self.kv_caches, strict=True))
        for i, (layer, kv_cache) in enumerate(layers[first:], start=first):
            table = self.cos_sin_local if layer.local_rope else self.cos_sin
            assert table is not None
            residual, delta = layer(positions, residual, delta, table, kv_cache, meta,
                                    prune=i == last)
        return self.ops.add_rms_norm(residual, delta, self.norm.weight, self.norm.eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V]
        """float32 logits, divided by `logits_divisor` and soft-capped where the family
        does that."""
        logits = self.lm_head(hidden).float()
        cfg = self.config
        if cfg.logits_divisor is not None:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def _native_stack(self) -> NativeStack | None:
        """The layers' parts for the native stack (kernels/cpu/stack.py), or None when the
        model is not of the Llama shape or a part does not fit the C (a projection whose
        product row has no stack descriptor, a bias but q|k|v's, caches it cannot read)."""
        cfg = self.config
        if not cfg.is_plain:
            return None
        parts: list[StackLayer] = []
        for layer, (k, v) in zip(self.decoder_layers(), self.kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            attn_in, ffn_in = layer.norm(ATTN_IN), layer.norm(FFN_IN)
            parts.append(StackLayer(
                input_norm=None if attn_in is None else attn_in.weight,
                post_norm=None if ffn_in is None else ffn_in.weight,
                qkv=attn.qkv_proj.stack_weight(), qkv_bias=attn.qkv_proj.bias,
                o=attn.o_proj.stack_weight(), gate_up=mlp.gate_up_proj.stack_weight(),
                down=mlp.down_proj.stack_weight(),
                extra_bias=any(lin.bias is not None for lin in
                               (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)),
                k_cache=k, v_cache=v, k_offset=attn.k_offset))
        shape = StackShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.rms_norm_eps)
        return gather_stack(parts, shape, self.norm.weight.detach(), self.cos_sin,
                            self.decoder_layers()[0].self_attn.scale, self.ops.compute_dtype)
