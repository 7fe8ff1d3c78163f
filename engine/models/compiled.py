"""Opt-in compiled forward (`EngineConfig.compile`): the decoder layers compiled by
torch.compile (inductor, CPU) into one graph, run for every step (prefill, decode, mixed).

The compiled unit is a pure function of the layers' tensors (norm weights, projection
weights, layer indices) passed as inputs, not frozen constants: the graph holds no copy of
the weights and no module identity. Two custom ops keep out of the graph what inductor
should not touch:

* `plait::linear`: the GEMMs, on the weights `prepack_cpu_linears` already packed for MKL
  or oneDNN and as native panels (inductor cannot take prepacked weights that are graph
  inputs, and its own packing needs frozen, per-layer constant weights);
* `plait::attention`: KV write + paged attention, whose shapes depend on the batch's
  metadata. It reads the step's `AttentionMetadata` and KV caches from `StepContext`, set
  around each compiled forward, and the layer index from a 0-d tensor input (an int would
  be a constant of the graph, one recompile per layer).

The compiled function loops over the layers, so one call (one guard check) runs the whole
stack; dynamo unrolls the loop and inductor compiles each distinct kernel once (a graph per
layer instead measured slower: dynamo's per-call overhead, ~0.2 ms, is paid 30 times). The token
dimension is dynamic (one graph for 2+ tokens; dynamo specializes 1 token), so no padding to
buckets; every other size is a constant of the graph. The embedding, final norm, LM head and
sampling stay eager. Every decoder of a process shares the compiled function's code, so
dynamo's cache holds two graphs per distinct model (shapes, bias or not, packed or not): a
decoder raises dynamo's per-function `recompile_limit` to at least `RECOMPILE_LIMIT`, and a
call that would pass it runs the same function uncompiled (correct, not faster; logged once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from plait.engine.models.cpu_linear import packed_linear
from plait.engine.models.llama import AttentionMetadata, LlamaForCausalLM, rms_norm
from plait.engine.models.rope import apply_rope
from plait.kernels import paged_attention, write_kv

logger = logging.getLogger("plait.engine")

# Graphs the compiled function may hold (two per distinct model) before calls run uncompiled.
RECOMPILE_LIMIT = 32

_LIB = torch.library.Library("plait", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? packed, Tensor? bias, Tensor? panels) "
            "-> Tensor")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor layer, float scale) -> Tensor")


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                 bias: torch.Tensor | None,
                 panels: torch.Tensor | None) -> torch.Tensor:  # [T, in] -> [T, out]
    """`packed_linear`: `weight` plain [out, in], `packed` and `panels` as
    `prepack_cpu_linears` left them."""
    return packed_linear(x, weight, packed, bias, panels).contiguous()


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                 bias: torch.Tensor | None, panels: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


# CompositeExplicitAutograd: one kernel for every backend key, packed (MkldnnCPU) included.
_LIB.impl("linear", _linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("plait::linear", _linear_fake, lib=_LIB)


@dataclass(slots=True)
class _Step:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


class _StepContext(threading.local):
    """The attention inputs of the compiled forward in progress in this thread."""

    current: _Step | None = None


StepContext = _StepContext()


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # [T, H(_kv), D]
                    layer: torch.Tensor, scale: float) -> torch.Tensor:  # [T, H, D]
    step = StepContext.current
    if step is None:
        raise RuntimeError("plait::attention called outside a compiled forward")
    meta = step.meta
    k_cache, v_cache = step.kv_caches[int(layer)]
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
        scale=scale, max_query_len=meta.max_query_len, max_context_len=meta.max_context_len)
    return out.contiguous()


def _attention_fake(q, k, v, layer, scale):
    return torch.empty_like(q)


_LIB.impl("attention", _attention_impl, "CompositeExplicitAutograd")
torch.library.register_fake("plait::attention", _attention_fake, lib=_LIB)


@dataclass(frozen=True, slots=True)
class _Dims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float


def _make_stack_fn(dims: _Dims) -> Callable[..., torch.Tensor]:
    """The function that gets compiled: every decoder layer, one after the other; `dims`
    are constants of the graph."""
    h, h_kv, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    split = (h * d, h_kv * d, h_kv * d)

    def layer_fn(x, positions, cos_sin, layer, ln1, qkv, qkv_bias, o, ln2, gate_up, down):
        # x: [T, hidden] -> [T, hidden]; each projection as (plain weight, packed or None,
        # native panels or None)
        t = x.shape[0]
        linear = torch.ops.plait.linear
        q, k, v = linear(rms_norm(x, ln1, dims.eps), qkv[0], qkv[1], qkv_bias,
                         qkv[2]).split(split, dim=-1)
        q, k = apply_rope(cos_sin, positions, q.reshape(t, h, d), k.reshape(t, h_kv, d))
        attn = torch.ops.plait.attention(q, k, v.reshape(t, h_kv, d), layer, dims.scale)
        x = x + linear(attn.reshape(t, h * d), o[0], o[1], None, o[2])
        gate, up = linear(rms_norm(x, ln2, dims.eps), gate_up[0], gate_up[1], None,
                          gate_up[2]).chunk(2, dim=-1)
        return x + linear(nn.functional.silu(gate) * up, down[0], down[1], None, down[2])

    def stack_fn(x, positions, cos_sin, layers):  # x: [T, hidden] -> [T, hidden]
        for tensors in layers:
            x = layer_fn(x, positions, cos_sin, *tensors)
        return x

    return stack_fn


def _weights(layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None,
                                        torch.Tensor | None]:
    return (layer.weight, getattr(layer, "packed_weight", None),
            getattr(layer, "panel_weight", None))


class CompiledDecoder:
    """`model`'s forward with its decoder layers run as one compiled graph.

    Same contract as `LlamaForCausalLM.forward` (CPU only). Compilation happens at the
    first call of each shape class (1 token, 2+ tokens); `warm_up` does it ahead.
    Call `refresh` after the model's weights (or their packing) change. `calls` counts the
    forwards run, `uncompiled_calls` those that ran uncompiled (see the module docstring).
    With `native_steps`, a step the model's one-call native stack takes
    (`LlamaForCausalLM.native_stack`: a decode step of a few rows) runs there instead of
    the graph: measured faster than the graph and its two custom ops per layer.
    """

    def __init__(self, model: LlamaForCausalLM, native_steps: bool = True) -> None:
        self.model = model
        self.native_steps = native_steps
        first = model.layers[0].self_attn
        dims = _Dims(first.num_heads, first.num_kv_heads, first.head_dim,
                     model.layers[0].input_layernorm.eps, first.scale)
        stack_fn = _make_stack_fn(dims)
        self._eager_fn = stack_fn
        self._fn = torch.compile(stack_fn, fullgraph=True)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        self.calls = 0
        self.uncompiled_calls = 0
        self.refresh()

    def refresh(self) -> None:
        """Collect each layer's tensors (call after weights or their packing change)."""
        self._layers = []
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self._layers.append((
                torch.tensor(i), layer.input_layernorm.weight, _weights(attn.qkv_proj),
                attn.qkv_proj.bias, _weights(attn.o_proj),
                layer.post_attention_layernorm.weight, _weights(mlp.gate_up_proj),
                _weights(mlp.down_proj)))

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,  # [K] rows whose states are needed (all: None)
    ) -> torch.Tensor:  # [T, hidden], or [K, hidden] with keep
        self.calls += 1
        model = self.model
        cos_sin = model.layers[0].self_attn.rope.cos_sin
        x = model.embed_tokens(input_ids)
        if self.native_steps:
            stacked = model.native_stack(x, positions, kv_caches, meta)
            if stacked is not None:
                return stacked if keep is None else stacked[keep]
        if x.shape[0] > 1:  # one graph for every token count but 1 (dynamo specializes it)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        StepContext.current = _Step(meta, kv_caches)
        try:
            try:
                x = self._fn(x, positions, cos_sin, self._layers)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                if not self.uncompiled_calls:
                    logger.warning("dynamo's recompile limit reached: this decoder's new "
                                   "shapes run uncompiled")
                self.uncompiled_calls += 1
                x = self._eager_fn(x, positions, cos_sin, self._layers)
        finally:
            StepContext.current = None
        return model.norm(x if keep is None else x[keep])

    def warm_up(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                block_size: int) -> float:
        """Compile both shape classes (1 token; 2+ tokens, which also serves prefills) with
        dummy decode steps; returns the seconds taken.

        The dummy steps write K/V into blocks 0 and 1: call before any request has cached
        anything."""
        start = time.perf_counter()
        native_steps, self.native_steps = self.native_steps, False  # compile both anyway
        try:
            for num in (1, 2):
                meta = AttentionMetadata(
                    slot_mapping=torch.arange(num, dtype=torch.int64) * block_size,
                    cu_seqlens_q=torch.arange(num + 1, dtype=torch.int32),
                    context_lens=torch.ones(num, dtype=torch.int32),
                    block_tables=torch.arange(num, dtype=torch.int32)[:, None],
                    max_query_len=1, max_context_len=1)
                ids = torch.zeros(num, dtype=torch.int64)
                with torch.inference_mode():
                    self(ids, torch.zeros(num, dtype=torch.int64), kv_caches, meta)
        finally:
            self.native_steps = native_steps
        seconds = time.perf_counter() - start
        logger.info("compiled the decoder stack in %.1f s", seconds)
        return seconds


__all__ = ["CompiledDecoder", "StepContext"]
