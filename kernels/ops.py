"""The ops table: what a decoder layer computes besides its GEMMs, one implementation per
backend, chosen once per engine (`select_ops`), as vLLM's `CustomOp` picks `forward_cpu` or
`forward_cuda` once:

    TorchOps      plain torch on any device (CPU without the native kernels, other dtypes)
    CpuNativeOps  float32 CPU through the native C kernels (kernels/cpu/)
    TritonOps     CUDA: the Triton paged-attention and KV-write kernels (kernels/cuda/)

`plan` is called by the runner once per step: the attention backend's work list for the
step's batch, carried on its `AttentionMetadata`. The GEMMs are the linear modules' own
(engine/models/linear.py); a table names the format the runner gives them at load
(`cpu_gemm`, `native`). `CpuNativeOps` also runs a whole decoder stack in one call for a
step of at most `stack_rows` tokens (`decoder_stack`): NATIVE_MAX_ROWS, or the bound stack's
`max_rows` once the model binds it (`bind_stack`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from plait.kernels.cpu import build, native, stack
from plait.kernels.cpu.attention import (
    cascade_attention_reference,
    native_attention,
    plan_cascade,
    plan_native,
)
from plait.kernels.cpu.products import in_prompt_rows
from plait.kernels.cpu.stack import NativeStack
from plait.kernels.metadata import AttentionMetadata, rows_metadata
from plait.kernels.reference import (
    paged_attention_reference,
    plan_reference,
    write_kv_reference,
)

logger = logging.getLogger("plait.kernels")

ATTENTION_BACKENDS = ("auto", "reference")  # as plait.engine.config lists them


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """The model's attention geometry and the cache's block size: what a table plans for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, D]
    """RMS normalization computed in float32 whatever the model dtype, as Hugging Face
    Llama does; returns x's dtype."""
    out = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return out.to(x.dtype)


def apply_rope(
    cos_sin: torch.Tensor,  # [max_positions, R] = cos | sin halves, R even, R <= D
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, H_kv, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions' angles, neox style, over the first R dims of each
    head (pairs (i, i + R/2), i < R/2); dims R..D pass through unchanged (partial rotary,
    Phi-3's R = 96 of D = 128). R == D rotates the whole head.

        head:  [x_0 .. x_{R/2-1} | x_{R/2} .. x_{R-1} | x_R .. x_{D-1}]
                 rotated with      their partners        unchanged
    """
    rot = check_rope_width(cos_sin, q.shape[-1])
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R/2] each
    if rot == q.shape[-1]:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    return (torch.cat([_rotate(q[..., :rot], cos, sin), q[..., rot:]], dim=-1),
            torch.cat([_rotate(k[..., :rot], cos, sin), k[..., rot:]], dim=-1))


def check_rope_width(cos_sin: torch.Tensor, head_dim: int) -> int:
    """The rotated width R of a cos | sin table [P, R]; ValueError unless R is even,
    0 < R <= head_dim."""
    rot = cos_sin.shape[-1]
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"a RoPE table of width {rot} for heads of {head_dim}: the width "
                         f"must be even, > 0 and <= the head size")
    return rot


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class TorchOps:
    """Plain torch, any device and dtype. Attention: the shared-prefix (cascade) backend in
    torch (`cpu/attention.py`), or with `cascade=False` the plain reference."""

    name = "torch"
    native = False  # whether the linear layers get native panels
    stack_rows = 0  # most tokens `decoder_stack` takes (0: it is not offered)
    # the dtype of the attention's dot products over a bfloat16 KV cache: float32 but in
    # CpuNativeOps built with compute_dtype bfloat16 (`native.kv_dtype_code`)
    compute_dtype = torch.float32

    def __init__(self, shape: AttentionShape, cascade: bool = True,
                 cpu_gemm: str = "none") -> None:
        self.shape = shape
        self.cascade = cascade
        self.cpu_gemm = cpu_gemm  # the linear layers' BLAS format on CPU (linear.py)

    def describe(self) -> str:
        return f"{self.name} ops ({self.attention_name()} attention, {self.cpu_gemm} GEMMs)"

    def attention_name(self) -> str:
        return "cascade" if self.cascade else "reference"

    # ------------------------------------------------------------------ per step
    def plan(self, meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
        """Compute `meta.plan` (and `meta.kept`'s, for `meta.keep`), once per step."""
        meta.plan = self._plan(meta)
        if meta.keep is not None:
            meta.kept = rows_metadata(meta, positions, meta.keep)
            meta.kept.plan = self._plan(meta.kept) if meta.keep.numel() else None
        return meta

    def _plan(self, meta: AttentionMetadata) -> object:
        args = (meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                self.shape.block_size, self.shape.group, meta.max_query_len,
                meta.max_context_len)
        return plan_cascade(*args) if self.cascade else plan_reference(*args)

    # ------------------------------------------------------------------ per layer
    def add_rms_norm(
        self,
        x: torch.Tensor,  # [T, D]
        add: torch.Tensor | None,  # [T, D], or None: nothing added
        weight: torch.Tensor,  # [D]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x + add, rms_norm(x + add)): [T, D] each
        """The residual add and the RMS norm that follows it."""
        total = x if add is None else x + add
        return total, rms_norm(total, weight, eps)

    def rope_write_kv(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, H_kv, D]
        v: torch.Tensor,  # [T, H_kv, D]
        cos_sin: torch.Tensor,  # [max_positions, R] cos | sin halves (R <= D: partial)
        positions: torch.Tensor,  # [T]
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
        k_offset: torch.Tensor | None = None,  # [H_kv, D] float32
    ) -> torch.Tensor:  # [T, H, D] q rotated
        """RoPE of q and k (`apply_rope`: the first R dims of each head), then k (less
        `k_offset` where given: the layer's key offset, engine/models/key_offset.py) and v
        written to the cache at their slots. The table is the caller's, per call (a model
        whose layers differ in theta passes each layer's own)."""
        q, k = apply_rope(cos_sin, positions, q, k)
        if k_offset is not None:
            k = k - k_offset
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k and v ([T, H_kv, D] each, any strides) written to the caches at their slots
        (every slot valid), cast to the cache's dtype; no RoPE (NoPE layers call it
        directly)."""
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping, padded=False)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,  # planned by `plan`
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal paged attention (the contract of `reference.paged_attention_reference`):
        `scale` multiplies q.k; `window` > 0 a sliding window (the query at p attends keys
        k with 0 <= p - k < window), `softcap` > 0 caps the scaled logits (softcap *
        tanh(s / softcap)); 0 turns either off. The step's plan serves any of them."""
        args = (q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                scale, meta.max_query_len, meta.max_context_len)
        if self.cascade:
            return cascade_attention_reference(*args, plan=meta.plan, window=window,
                                               softcap=softcap)
        return paged_attention_reference(*args, plan=meta.plan, window=window,
                                         softcap=softcap)

    def bind_stack(self, native_stack: NativeStack) -> None:
        raise NotImplementedError(f"{self.name} ops run no whole decoder stack")

    def decoder_stack(self, stack: NativeStack, x: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} ops run no whole decoder stack")


class CpuNativeOps(TorchOps):
    """float32 CPU through the native kernels: every per-row op is one C pass, attention
    reads the cache in place (with `cascade`; else the plain torch reference), and a step
    of at most `stack_rows` tokens can run every layer in one call. `compute_dtype`
    bfloat16 (the engine's): over a bfloat16 KV cache, the native attention's tokens with
    bf16 dot products, here and in the
    model's native stack."""

    name = "cpu-native"
    native = True

    def __init__(self, shape: AttentionShape, cascade: bool = True,
                 cpu_gemm: str = "none", compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(shape, cascade, cpu_gemm)
        self.compute_dtype = compute_dtype
        self.native_attention = cascade and native.supports_attention(
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size)
        self.stack_rows = build.NATIVE_MAX_ROWS if self.native_attention \
            and shape.head_dim % 2 == 0 else 0

    def describe(self) -> str:
        return f"{self.name} ops ({self.attention_name()} attention, native panels then " \
            f"{self.cpu_gemm} GEMMs, whole stack up to {self.stack_rows} tokens)"

    def attention_name(self) -> str:
        return "native" if self.native_attention else super().attention_name()

    def plan(self, meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
        meta = super().plan(meta, positions)
        rows = meta.slot_mapping.shape[0]
        meta.whole_stack = 0 < rows <= self.stack_rows
        return meta

    def _plan(self, meta: AttentionMetadata) -> object:
        if not self.native_attention:
            return super()._plan(meta)
        return plan_native(meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                           self.shape.block_size, self.shape.group, meta.max_query_len,
                           meta.max_context_len)

    # the same contracts as TorchOps', one C pass each (kernels/cpu/rowwise.c)
    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return native.add_rms_norm(x, add, weight, eps)

    def rope_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_offset: torch.Tensor | None = None) -> torch.Tensor:
        return native.rope_write_kv(q, k, v, cos_sin, positions, k_cache, v_cache,
                                    slot_mapping, k_offset)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return native.silu_mul(gate_up)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0,
                  softcap: float = 0.0) -> torch.Tensor:
        if not self.native_attention:
            return super().attention(q, k_cache, v_cache, meta, scale, window, softcap)
        prompt = in_prompt_rows() and native.takes_prompt_rows(
            k_cache, self.compute_dtype, q.shape[-1], window, softcap)
        return native_attention(q, k_cache, v_cache, meta.block_tables, meta.plan, scale,
                                self.compute_dtype, window, softcap, prompt)

    def bind_stack(self, native_stack: NativeStack) -> None:
        """The model's stack, bound at load: steps of up to its `max_rows` tokens are
        planned `whole_stack` from now on (more than NATIVE_MAX_ROWS, a prompt's, where its
        every product computes any rows as the layer loop does)."""
        if native_stack.max_rows != self.stack_rows:
            logger.info("whole decoder stack up to %d tokens", native_stack.max_rows)
        self.stack_rows = native_stack.max_rows

    def decoder_stack(self, native_stack: NativeStack, x: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """Every layer and the final norm in one native call (`stack.decoder_stack`), for
        a step `plan` marked `whole_stack`; `native_stack` is the model's, bound at load.
        In a prompt pass (`in_prompt_rows()`), with the prompt rows' products and attention.
        With `num_layers`, only those first layers: their last MLP output, x the stream."""
        rows = meta.plan
        return stack.decoder_stack(
            native_stack, x, positions.to(torch.int64).contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous(), meta.block_tables.int().contiguous(),
            rows.chunk_start, rows.chunk_shared, rows.q_rows, rows.table_rows, rows.ctx_lens,
            prompt=in_prompt_rows(), num_layers=num_layers)


class TritonOps(TorchOps):
    """CUDA: Triton kernels for the KV write and the paged attention (kernels/cuda/); the
    per-row ops in torch."""

    name = "triton"

    def __init__(self, shape: AttentionShape, cascade: bool = True,
                 cpu_gemm: str = "none") -> None:
        super().__init__(shape, cascade=False, cpu_gemm=cpu_gemm)

    def attention_name(self) -> str:
        return "Triton"

    def _plan(self, meta: AttentionMetadata) -> object:
        return None  # the Triton launcher works from the metadata's tensors alone

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        from plait.kernels.cuda.write_kv import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0,
                  softcap: float = 0.0) -> torch.Tensor:
        from plait.kernels.cuda.attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
            scale=scale, max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len, window=window, softcap=softcap)


def select_ops(device: torch.device, dtype: torch.dtype, shape: AttentionShape, *,
               native_kernels: bool = True, cascade: bool = True,
               attention_backend: str = "auto", cpu_gemm: str = "none",
               compute_dtype: torch.dtype = torch.float32) -> TorchOps:
    """The ops table for an engine on `device` with weights and activations of `dtype`:

    * CUDA with triton importable and `attention_backend` "auto": `TritonOps`;
    * float32 CPU with `native_kernels` and the kernels built here: `CpuNativeOps`;
    * otherwise `TorchOps` (the plain reference attention with `attention_backend`
      "reference" or `cascade` False, else the torch cascade).

    `cpu_gemm` is the BLAS format the CPU linear layers get (a resolved `products.BLAS`
    name); `compute_dtype` the engine's (`CpuNativeOps`' attention over bf16 caches). Logged
    once; never changes afterwards but for `stack_rows`, which the model's stack sets when
    it is bound (`bind_stack`)."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"not {attention_backend!r}")
    cascade = cascade and attention_backend == "auto"
    if device.type == "cuda" and attention_backend == "auto" and _triton_importable():
        ops: TorchOps = TritonOps(shape, cpu_gemm=cpu_gemm)
    elif device.type == "cpu" and dtype == torch.float32 and native_kernels \
            and build.available():
        ops = CpuNativeOps(shape, cascade, cpu_gemm, compute_dtype)
    else:
        ops = TorchOps(shape, cascade, cpu_gemm)
    logger.info("%s", ops.describe())
    return ops


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["ATTENTION_BACKENDS", "AttentionShape", "CpuNativeOps", "TorchOps", "TritonOps",
           "apply_rope", "check_rope_width", "rms_norm", "select_ops"]
