"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

One forward call takes a flattened variable-length batch that can mix prefills (with or
without an already-cached prefix) and decodes (`input_ids [T]`, `positions [T]`, and the
step's `AttentionMetadata`, planned by the ops table; see plait.kernels.metadata). Every
operation besides the GEMMs goes through the ops table the model was built with
(plait.kernels.ops); the linear layers run their own weight format (linear.py).

Each layer writes the new K/V into its cache before attention reads it, so a sequence can
attend to blocks another sequence of the same batch is computing in this very call. The
residual stream is carried beside each sublayer's output and added inside the next norm
(`add_rms_norm`), the order the native whole-stack call (kernels/cpu/decoder.c) mirrors.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from plait.engine.model_config import ModelConfig
from plait.engine.models.linear import (
    INT8_MIN_ROWS,
    Linear,
    PanelLinear,
    QuantEmbedding,
    QuantLinear,
)
from plait.engine.models.rope import rope_cos_sin
from plait.kernels import AttentionMetadata, TorchOps
from plait.kernels.cpu import native

# The most bytes of an int8 MLP chunk's [rows, I] float32 silu(gate) * up (see MLP.forward):
# under host_memory.MMAP_THRESHOLD (32 MiB), so chunks reuse the heap's mapped pages.
MLP_CHUNK_BYTES = 24 << 20

KVCache = tuple[torch.Tensor, torch.Tensor]  # 2 x [num_blocks, block_size, H_kv, D]


class RMSNorm(nn.Module):
    """An RMS norm's weight and epsilon; applied, with the residual add before it, by the
    ops table's `add_rms_norm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q, k and v projections fused into one matmul; loaded from the separate HF weights.
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        cos_sin: torch.Tensor,  # [max_positions, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        prune: bool = False,
    ) -> torch.Tensor:  # [T, hidden], or [K, hidden] when pruned
        """Every token's K/V is written; with `prune` and `meta.keep`, only those rows
        attend and come out."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        q = self.ops.rope_write_kv(q, k, v, cos_sin, positions, k_cache, v_cache,
                                   meta.slot_mapping)
        if prune and meta.keep is not None:
            if meta.keep.numel() == 0:
                return x.new_empty(0, self.o_proj.out_features)
            assert meta.kept is not None, "plan the step (ops.plan) before the forward"
            q, meta = q[meta.keep], meta.kept
        out = self.ops.attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(q.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        # gate and up projections fused: [T, hidden] -> [T, 2 * intermediate]
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate_up, down, rows = self.gate_up_proj, self.down_proj, x.shape[0]
        if isinstance(gate_up, QuantLinear) and isinstance(down, QuantLinear) \
                and gate_up.takes_int8(rows) and down.takes_int8(rows) \
                and gate_up.out_features % 32 == 0:
            # int8 gate_up with silu_mul fused (no [T, 2 I] product), in row chunks whose
            # [rows, I] float32 stays below glibc's raised mmap threshold (host_memory.py),
            # so each chunk reuses mapped pages instead of faulting in a fresh mapping; a
            # row's result does not depend on its chunk
            most = max(INT8_MIN_ROWS, MLP_CHUNK_BYTES // (2 * gate_up.out_features))
            if rows <= most:  # one chunk: no copy through torch.cat
                return down.product_int8(gate_up.silu_mul_int8(x))
            chunk = -(-rows // -(-rows // most))  # equal chunks, each at most `most` rows
            return torch.cat([down.product_int8(gate_up.silu_mul_int8(x[i:i + chunk]))
                              for i in range(0, rows, chunk)])
        if isinstance(gate_up, QuantLinear) and isinstance(down, QuantLinear) \
                and gate_up.rounds_to_bf16(rows) and down.rounds_to_bf16(rows):
            # both products in bf16 BLAS: gate_up's bf16 output goes to the native silu_mul
            # as it is and its bf16 result to down_proj, which rounds its input to bf16
            # anyway: the bits of the float32 path below with the native ops, without two
            # float32 copies of [T, 2 I] and [T, I] (QuantLinear implies the native kernels)
            return down(native.silu_mul(gate_up(x, widen=False)))
        return down(self.ops.silu_mul(gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ops)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        residual: torch.Tensor,  # [T, hidden] the stream (the embeddings for layer 0)
        delta: torch.Tensor | None,  # [T, hidden] the last MLP's output; None for layer 0
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        prune: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (residual, delta): [T or K, hidden] each
        """residual + delta through this layer; the new stream and this layer's MLP output
        (added by the next norm). With `prune` and `meta.keep`, only those rows come out."""
        norm = self.input_layernorm
        residual, h = self.ops.add_rms_norm(residual, delta, norm.weight, norm.eps)
        attn = self.self_attn(positions, h, cos_sin, kv_cache, meta, prune)
        if prune and meta.keep is not None:
            residual = residual[meta.keep]
        norm = self.post_attention_layernorm
        residual, h = self.ops.add_rms_norm(residual, attn, norm.weight, norm.eps)
        return residual, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head; `forward` returns hidden states, `compute_logits` the logits
    of only the rows that need sampling. `bind` gives it its KV caches once."""

    cos_sin: torch.Tensor  # [max_positions, head_dim] = cos | sin halves (a buffer)
    embed_tokens: nn.Embedding | QuantEmbedding  # the GGUF loader may keep it quantized
    lm_head: Linear

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: TorchOps) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.register_buffer("cos_sin", rope_cos_sin(cfg.head_dim, max_positions,
                                                     cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_caches: list[KVCache] = []
        self.stack: native.NativeStack | None = None

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed (an `nn.ModuleList` yields plain modules)."""
        return cast(list[DecoderLayer], list(self.layers))

    def bind(self, kv_caches: list[KVCache]) -> None:
        """Give the model its KV caches (one (k, v) per layer), after its linear layers have
        their final format: where the ops table runs whole stacks, the layers' addresses
        are gathered here, once."""
        self.kv_caches = list(kv_caches)
        self.stack = self._native_stack() if self.ops.stack_rows else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,  # planned by `ops.plan`
    ) -> torch.Tensor:  # [T, hidden], or [K, hidden] (rows `meta.keep`)
        """The final hidden states of every token, or with `meta.keep` of those rows only:
        the last layer then writes every token's K/V but attends and runs its MLP for those
        rows alone (a prefill chunk samples one row of hundreds: ~1/36 of its GEMMs saved)."""
        x = self.embed_tokens(input_ids)
        if meta.whole_stack and self.stack is not None:
            hidden = self.ops.decoder_stack(self.stack, x, positions, meta)
            return hidden if meta.keep is None else hidden[meta.keep]
        residual, delta = x, None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, self.kv_caches, strict=True)):
            residual, delta = layer(positions, residual, delta, self.cos_sin, kv_cache, meta,
                                    prune=i == last)
        return self.ops.add_rms_norm(residual, delta, self.norm.weight, self.norm.eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V]
        return self.lm_head(hidden).float()

    def _native_stack(self) -> native.NativeStack | None:
        """The layers' addresses for `native.decoder_stack`, or None when a layer does not
        fit it (every projection in native panels or kept in a format the native kernels
        take, no bias but q|k|v's, float32 dense; KV caches the kernels take)."""
        cfg = self.config

        def dense(t: torch.Tensor | None) -> bool:
            return t is not None and t.dtype == torch.float32 and t.device.type == "cpu" \
                and t.is_contiguous()

        def address(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        layers = self.decoder_layers()
        rows: list[list[int]] = []
        tensors: list[torch.Tensor] = []
        for layer, (k, v) in zip(layers, self.kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [w for lin in linears if (w := _stack_weight(lin)) is not None]
            if len(weights) < len(linears):
                return None
            bias = attn.qkv_proj.bias
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(dense(t) for t in norms) or not native.kv_caches_fit(k, v) \
                    or any(lin.bias is not None for lin in linears[1:]) \
                    or (bias is not None and not dense(bias)):
                return None
            descs = [w[0] for w in weights]
            named: dict[str, torch.Tensor | None] = {
                "input_norm": norms[0], "qkv_weight": descs[0], "qkv_bias": bias,
                "o_weight": descs[1], "post_norm": norms[1], "gate_up_weight": descs[2],
                "down_weight": descs[3], "k_cache": k, "v_cache": v}
            rows.append([address(named[n]) for n in native.STACK_POINTERS])
            tensors += [t for w in weights for t in w[1]]
            tensors += [t for t in named.values() if t is not None]
        if not dense(self.norm.weight) or not dense(self.cos_sin):
            return None
        shape = native.StackShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
        k_cache, v_cache = self.kv_caches[0]
        return native.NativeStack(
            torch.tensor(rows, dtype=torch.int64), shape, self.norm.weight.detach(),
            self.cos_sin, native.kv_dtype_code(k_cache, v_cache, self.ops.compute_dtype),
            k_cache.shape[1], layers[0].self_attn.scale, tuple(tensors))


def _stack_weight(linear: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """A projection's weight descriptor for the native stack and the tensors it points
    into, or None when the stack cannot take it."""
    if isinstance(linear, PanelLinear) and linear.panels.is_contiguous():
        return native.panels_desc(linear.panels, linear.out_features), [linear.panels]
    if isinstance(linear, QuantLinear):  # its parts are native types (check_native)
        desc = linear.descriptor()  # qgemm's, as forward gives it
        held = [part.data for part in linear.qweight.parts]
        return desc, held if linear.i8_panels is None else [*held, linear.i8_panels]
    return None
