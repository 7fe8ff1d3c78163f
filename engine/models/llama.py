"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

One forward call takes a flattened variable-length batch that can mix prefills (with or
without an already-cached prefix) and decodes:

    input_ids  [T]   tokens to compute, sequence after sequence
    positions  [T]   absolute position of each token in its sequence
    metadata         slot_mapping [T], cu_seqlens_q [S+1], context_lens [S],
                     block_tables [S, max_blocks] (see plait.kernels.reference)

Each layer writes the new K/V into its cache before attention reads it, so a sequence can
attend to blocks another sequence of the same batch is computing in this very call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.engine.model_config import ModelConfig
from plait.engine.models.cpu_linear import NATIVE_MAX_ROWS, linear
from plait.engine.models.rope import RotaryEmbedding
from plait.kernels import native, paged_attention, write_kv
from plait.kernels.cascade import native_plan


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to (shared by layers)."""

    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with -1
    max_query_len: int
    max_context_len: int


def rows_metadata(meta: AttentionMetadata, positions: torch.Tensor,
                  rows: torch.Tensor) -> AttentionMetadata:
    """`meta` for only the query tokens `rows` ([K] int64, increasing) of its batch: each
    one a sequence of one query that attends its context up to and including itself (its
    K/V already written), through its sequence's block table."""
    seq = torch.searchsorted(meta.cu_seqlens_q[1:].to(torch.int64), rows, right=True)
    ctx = (positions[rows] + 1).to(torch.int32)  # [K]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        cu_seqlens_q=torch.arange(rows.shape[0] + 1, dtype=torch.int32, device=rows.device),
        context_lens=ctx, block_tables=meta.block_tables[seq], max_query_len=1,
        max_context_len=int(ctx.max()) if rows.numel() else 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, D]
    """RMS normalization computed in float32 whatever the model dtype, as Hugging Face
    Llama does; returns x's dtype."""
    out = nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D]
        if native.rows_fit(x):  # one C pass per row (CPU float32)
            return native.add_rms_norm(x, None, self.weight, self.eps)[1]
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q, k and v projections fused into one matmul; loaded from the separate HF weights.
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, H_kv, D]
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,  # [K] int64 rows whose output is needed
    ) -> torch.Tensor:  # [T, hidden], or [K, hidden] with keep
        """Every token's K/V is written; with `keep`, only those rows attend and come out."""
        num_tokens = x.shape[0]
        q, k, v = linear(self.qkv_proj, x).split(self.split, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if native.rope_fits(q, k, v, k_cache, v_cache):  # one pass, same bits
            native.rope_write_kv(q, k, v, self.rope.cos_sin, positions, k_cache, v_cache,
                                 meta.slot_mapping)
        else:
            q, k = self.rope(positions, q, k)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if keep is not None:
            if keep.numel() == 0:
                return x.new_empty(0, self.o_proj.out_features)
            q, meta, num_tokens = q[keep], rows_metadata(meta, positions, keep), keep.numel()
        out = paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
            scale=self.scale, max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len,
        )
        return linear(self.o_proj, out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up projections fused: [T, hidden] -> [T, 2 * intermediate]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(self.gate_up_proj, x)
        if native.rows_fit(gate_up):
            return linear(self.down_proj, native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(self.down_proj, nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, x, kv_cache, meta, keep=None):  # x: [T, hidden]
        """[T, hidden]; with `keep` ([K] rows), every row's K/V but only those rows out."""
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, keep)
        if keep is not None:
            x = x[keep]
        if native.rows_fit(x, attn):  # the residual add fused into the norm
            norm = self.post_attention_layernorm
            x, h = native.add_rms_norm(x, attn, norm.weight, norm.eps)
            return x + self.mlp(h)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head; `forward` returns hidden states, `compute_logits` the logits
    of only the rows that need sampling."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (k, v) per layer
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,  # [K] int64 increasing rows whose states are needed
    ) -> torch.Tensor:  # [T, hidden], or [K, hidden] (rows `keep`)
        """The final hidden states of every token, or with `keep` of those rows only: the
        last layer then writes every token's K/V but attends and runs its MLP for those
        rows alone (a prefill chunk samples one row of hundreds: ~1/36 of its GEMMs saved)."""
        x = self.embed_tokens(input_ids)
        stacked = self.native_stack(x, positions, kv_caches, meta)
        if stacked is not None:
            return stacked if keep is None else stacked[keep]
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(positions, x, kv_cache, meta, keep if i == last else None)
        return self.norm(x)

    def native_stack(
        self,
        x: torch.Tensor,  # [T, hidden] the step's embeddings (overwritten)
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # [T, hidden], or None: not taken
        """The decoder layers and final norm in one native call (`native.decoder_stack`)
        for a step of at most `NATIVE_MAX_ROWS` tokens where every kernel of the layers'
        eager path would be native anyway (float32 CPU, projections packed as panels, no
        bias but q|k|v's, native attention for this batch); the same bits as that path,
        without ~10 Python calls per layer. None when any of it does not hold."""
        if not 0 < x.shape[0] <= NATIVE_MAX_ROWS or not native.rows_fit(x) \
                or not x.is_contiguous():
            return None
        table = self._stack_table(kv_caches)
        if table is None:
            return None
        block_size = kv_caches[0][0].shape[1]
        group = self.config.num_heads // self.config.num_kv_heads
        plan = native_plan(meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                           block_size, group, meta.max_query_len, meta.max_context_len)
        if plan is None:
            return None
        attn, cfg = self.layers[0].self_attn, self.config
        shape = native.StackShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
        return native.decoder_stack(
            table, shape, x, self.norm.weight, attn.rope.cos_sin,
            positions.to(torch.int64).contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous(), block_size,
            meta.block_tables.int().contiguous(), plan.chunk_start, plan.chunk_shared,
            plan.q_rows, plan.table_rows, plan.ctx_lens, attn.scale)

    def _stack_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     ) -> torch.Tensor | None:
        """The layers' addresses for `native.decoder_stack` ([L, 9] int64), None when a
        layer does not fit it. Cached while the caches and the packed panels are the same
        tensors (`prepack_cpu_linears` replaces every panel at once)."""
        key = (getattr(self.layers[0].self_attn.qkv_proj, "panel_weight", None),
               *(t for kv in kv_caches for t in kv))
        cached = getattr(self, "_stack_cache", None)
        if cached is not None and len(cached[0]) == len(key) \
                and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        table = self._build_stack_table(kv_caches)
        self._stack_cache = (key, table)
        return table

    def _build_stack_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           ) -> torch.Tensor | None:
        cfg = self.config
        k_cache = kv_caches[0][0]
        if not (native.available() and cfg.head_dim % 2 == 0
                and native.supports_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                              k_cache.shape[1])):
            return None

        def dense(t: torch.Tensor | None) -> bool:
            return t is not None and t.dtype == torch.float32 and t.device.type == "cpu" \
                and t.is_contiguous()

        rows = []
        for layer, (k, v) in zip(self.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            panels = [getattr(lin, "panel_weight", None) for lin in linears]
            bias = attn.qkv_proj.bias
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(dense(t) for t in (*panels, *norms, k, v)) \
                    or any(lin.bias is not None for lin in linears[1:]) \
                    or (bias is not None and not dense(bias)):
                return None
            rows.append([norms[0].data_ptr(), panels[0].data_ptr(),
                         0 if bias is None else bias.data_ptr(), panels[1].data_ptr(),
                         norms[1].data_ptr(), panels[2].data_ptr(), panels[3].data_ptr(),
                         k.data_ptr(), v.data_ptr()])
        if not dense(self.norm.weight) or not dense(self.layers[0].self_attn.rope.cos_sin):
            return None
        return torch.tensor(rows, dtype=torch.int64)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V]
        return linear(self.lm_head, hidden).float()
