"""The decoder layer's parts, for every supported family (model_config.py lists the
variants): norms, attention, the gated MLP, and the layer that wires them.

The residual stream is carried beside each sublayer's output and added inside the next
norm (`add_rms_norm`), the order the native whole-stack call (kernels/cpu/decoder.c)
mirrors. A layer of the Llama shape runs exactly the ops it always ran; a variant adds
its own steps around them:

    "pre"        x -> [attn in] -> attn ------------> + -> [ffn in] -> mlp ------------> +
    "sandwich"   x -> [attn in] -> attn -> [attn out] -> + -> [ffn in] -> mlp -> [ffn out] -> +
    "post"       x -------------> attn -> [attn out] -> + -------------> mlp -> [ffn out] -> +

Each norm is a module named as the family's Hugging Face checkpoint names it (`NORMS`),
so the safetensors loader finds its weight by name.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.engine.model_config import ModelConfig
from plait.engine.models.key_offset import key_offset, uses_key_offset
from plait.engine.models.linear import Linear
from plait.kernels import AttentionMetadata, TorchOps

KVCache = tuple[torch.Tensor, torch.Tensor]  # 2 x [num_blocks, block_size, H_kv, D]

# norm layout -> the HF module names of its norms by role (None: the layout has none):
# (attention input, attention output, MLP input, MLP output), indexed by the roles below.
# GGUF names the same roles attn_norm, post_attention_norm, ffn_norm, post_ffw_norm.
ATTN_IN, ATTN_OUT, FFN_IN, FFN_OUT = range(4)
NORMS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


class RMSNorm(nn.Module):
    """An RMS norm's weight and epsilon; applied, with the residual add before it, by the
    ops table's `add_rms_norm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    """q|k|v projection, optional q/k norms, RoPE (over the first `rotary_dim` dims, or none
    on a NoPE layer), the KV write, paged attention (windowed / soft-capped per the
    config), output projection."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, layer_idx: int = 0) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q, k and v projections fused into one matmul; loaded from the separate HF weights.
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attention_scale or self.head_dim**-0.5
        self.window = cfg.window_of(layer_idx)
        self.softcap = cfg.attn_softcap
        self.rope = layer_idx not in cfg.nope_layers
        # "head": one norm over each head's D dims; "proj": over the whole projection
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else kv_size, cfg.rms_norm_eps)
        # [H_kv, D] subtracted from every stored key (key_offset.py), set by `bind_cache`
        self.k_offset: torch.Tensor | None = None

    def key_offset(self, cos_sin: torch.Tensor) -> torch.Tensor | None:
        """[H_kv, D]: the key offset of this layer's loaded k bias and RoPE table
        (key_offset.py), whatever the cache; None without a bias."""
        bias = self.qkv_proj.bias
        if bias is None:
            return None
        q_size, kv_size, _ = self.split
        return key_offset(bias[q_size:q_size + kv_size], self.num_kv_heads, self.head_dim,
                          cos_sin if self.rope else None)

    def bind_cache(self, cache_dtype: torch.dtype, cos_sin: torch.Tensor) -> None:
        """Set `k_offset` for a cache of `cache_dtype`: `key_offset`, or None where the
        layer does not use one."""
        used = uses_key_offset(cache_dtype, self.qkv_proj.bias is not None, self.softcap,
                               self.qk_norm)
        self.k_offset = self.key_offset(cos_sin) if used else None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        cos_sin: torch.Tensor,  # [max_positions, R] this layer's RoPE table
        kv_cache: KVCache,
        meta: AttentionMetadata,
        prune: bool = False,
    ) -> torch.Tensor:  # [T, hidden], or [K, hidden] when pruned
        """Every token's K/V is written; with `prune` and `meta.keep`, only those rows
        attend and come out."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        if self.qk_norm is not None:
            q, k = self._norm_qk(q, k)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if self.rope:
            q = self.ops.rope_write_kv(q, k, v, cos_sin, positions, k_cache, v_cache,
                                       meta.slot_mapping, self.k_offset)
        else:  # a NoPE layer: q and k as they are
            stored = k if self.k_offset is None else k - self.k_offset
            self.ops.write_kv(stored, v, k_cache, v_cache, meta.slot_mapping)
        if prune and meta.keep is not None:
            if meta.keep.numel() == 0:
                return x.new_empty(0, self.o_proj.out_features)
            assert meta.kept is not None, "plan the step (ops.plan) before the forward"
            q, meta = q[meta.keep], meta.kept
        if self.window or self.softcap:
            out = self.ops.attention(q, k_cache, v_cache, meta, self.scale,
                                     window=self.window, softcap=self.softcap)
        else:
            out = self.ops.attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(q.shape[0], -1))

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H D], [T, H_kv D]
        """q and k through their RMS norms, per head or over the whole projection."""
        dim = self.head_dim if self.qk_norm == "head" else None
        out = []
        for x, norm in ((q, self.q_norm), (k, self.k_norm)):
            rows = x if dim is None else x.reshape(-1, dim)  # [T H, D] per head
            normed = self.ops.add_rms_norm(rows, None, norm.weight, norm.eps)[1]
            out.append(normed.reshape(x.shape))
        return out[0], out[1]


class MLP(nn.Module):
    """down(silu(gate) * up), gate and up fused into one projection."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        # gate and up projections fused: [T, hidden] -> [T, 2 * intermediate]
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        """down(silu_mul(gate_up(x))). The fused SiLU kernel of gate_up's product row is
        used where down runs the same row (which takes its output as it is); that row may
        ask for row chunks (bounded temporaries), each computed as the whole's rows are (a
        row's result does not depend on its chunk)."""
        gate_up, down, rows = self.gate_up_proj, self.down_proj, x.shape[0]
        fused = gate_up.product is down.product
        chunk = gate_up.chunk_rows(rows) if fused else None
        if chunk is None:
            return down(gate_up.silu_mul(x, fused))
        return torch.cat([down(gate_up.silu_mul(x[i:i + chunk], fused, rows), rows)
                          for i in range(0, rows, chunk)])


class GeluMLP(MLP):
    """down(gelu_tanh(gate) * up) (Gemma): in torch on the products, which the kept formats
    compute as for SiLU; the ops table has no fused GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    """One block: norms per `NORMS[cfg.norm_layout]`, attention, MLP; sublayer outputs
    times `residual_scale` where the family has one (granite)."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, layer_idx: int = 0) -> None:
        super().__init__()
        self.ops = ops
        self.norm_names = NORMS[cfg.norm_layout]
        for name in self.norm_names:
            if name is not None:
                setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.self_attn = Attention(cfg, ops, layer_idx)
        self.mlp = (GeluMLP if cfg.hidden_act == "gelu_tanh" else MLP)(cfg, ops)
        self.residual_scale = cfg.residual_scale
        # the windowed layers of a model with its own local RoPE base use that table
        self.local_rope = cfg.local_rope_theta is not None and cfg.window_of(layer_idx) > 0

    def norm(self, role: int) -> RMSNorm | None:
        """The norm of `role` (ATTN_IN, ATTN_OUT, FFN_IN or FFN_OUT), or None."""
        name = self.norm_names[role]
        return None if name is None else getattr(self, name)

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
        residual, h = self._enter(residual, delta, self.norm(ATTN_IN))
        attn = self.self_attn(positions, h, cos_sin, kv_cache, meta, prune)
        if prune and meta.keep is not None:
            residual = residual[meta.keep]
        attn = self._leave(attn, self.norm(ATTN_OUT))
        residual, h = self._enter(residual, attn, self.norm(FFN_IN))
        return residual, self._leave(self.mlp(h), self.norm(FFN_OUT))

    def _enter(self, residual: torch.Tensor, delta: torch.Tensor | None,
               norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, the sublayer's input: that sum normed, or as it is)."""
        if norm is not None:
            return self.ops.add_rms_norm(residual, delta, norm.weight, norm.eps)
        total = residual if delta is None else residual + delta
        return total, total

    def _leave(self, out: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """A sublayer's output as the stream adds it: normed, scaled, or as it is."""
        if norm is not None:
            out = self.ops.add_rms_norm(out, None, norm.weight, norm.eps)[1]
        if self.residual_scale is not None:
            out = out * self.residual_scale
        return out
