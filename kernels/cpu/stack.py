"""The native decoder stack (kernels/cpu/decoder.c): a step's whole Llama decoder in one C
call, and the pointer table it reads, gathered here once at load from each layer's parts.

`gather_stack` takes the layers as `StackLayer`s (norm weights, the projections' stack
descriptors from the product table, the KV caches) and returns a `NativeStack`, or None when
a layer does not fit the C (then the model runs layer by layer through the ops table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.kernels.cpu import native, repack
from plait.kernels.cpu.build import ABI, NATIVE_MAX_ROWS, STACK_POINTERS, check_rc, loaded
from plait.kernels.cpu.products import MLP_CHUNK_BYTES, StackWeight

# OR-ed into the stack's kv_dtype for prompt rows (plait_cpu.h's PLAIT_STACK_PROMPT).
STACK_PROMPT = ABI.constants["PLAIT_STACK_PROMPT"]
# The most bytes of decoder.c's float32 buffers ([rows, hidden + (H + 2 H_kv) D + H D +
# 3 I + hidden], one malloc a call) for a step of more than NATIVE_MAX_ROWS rows: under
# host_memory.MMAP_THRESHOLD, as a repacked MLP chunk's, so each call reuses the heap's
# pages instead of faulting in a fresh mapping.
STACK_BYTES = MLP_CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class StackShape:
    """The sizes of a Llama decoder stack that `decoder_stack` needs beside its pointers."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


@dataclass(frozen=True, slots=True)
class NativeStack:
    """A model's decoder stack bound to its KV caches, as `decoder_stack` takes it: built
    once at load (`LlamaForCausalLM.bind`). `tensors` keeps every tensor whose address
    `layers` holds alive.

    Its limits: every layer is a Llama layer with full causal attention (no sliding
    window, no logit softcap), RoPE over whole heads from the one `cos_sin` table (one
    theta for every layer, no partial rotary, no NoPE layer), pre-norms only. A model with
    any of those variants must not bind a stack (it runs layer by layer through the ops
    table, which takes them)."""

    layers: torch.Tensor  # [L, len(STACK_POINTERS)] int64 addresses, 0 = no bias; the
    # projections' are those of int64 descriptors (`QuantWeight.desc`, `panels_desc`)
    shape: StackShape
    final_norm: torch.Tensor  # [hidden] float32
    cos_sin: torch.Tensor  # [max_positions, D] float32 contiguous: cos | sin halves
    kv_dtype: int  # `kv_dtype_code` of the caches (and the compute dtype)
    # kv_dtype for prompt rows (`decoder_stack`'s `prompt`): with PLAIT_STACK_PROMPT where
    # `repack.prompt_bf16()`, and ATTN_AMX where the layers' attention takes prompt rows
    # there (`native.takes_prompt_rows`), as the layer-by-layer prompt pass computes them
    prompt_kv_dtype: int
    block_size: int
    scale: float
    tensors: tuple[torch.Tensor, ...]
    # the most rows a step may have to run here with the layer loop's bits (`stack_rows`)
    max_rows: int = NATIVE_MAX_ROWS


def decoder_stack(
    stack: NativeStack,
    x: torch.Tensor,  # [T, hidden] float32 dense: the embeddings, then the residual stream
    positions: torch.Tensor,  # [T] int64 contiguous
    slot_mapping: torch.Tensor,  # [T] int64 contiguous, -1 = not written
    block_tables: torch.Tensor,  # [S, W] int32 contiguous
    chunk_start: torch.Tensor,  # [C + 1] int64, as `decode_attention` takes them
    chunk_shared: torch.Tensor,  # [C] int32
    q_rows: torch.Tensor,  # [T] int64: token row of each attention row, chunk order
    table_rows: torch.Tensor,  # [T] int64
    ctx_lens: torch.Tensor,  # [T] int32
    prompt: bool = False,  # the rows are prompt rows (`products.in_prompt_rows()`)
    num_layers: int | None = None,  # only the first this many layers (>= 1), no final norm
) -> torch.Tensor:  # [T, hidden] float32: the final norm of the last residual stream
    """Every layer of a Llama decoder over the T tokens of a step, one token per sequence
    (T at most `stack.max_rows`; every projection a `qgemm` descriptor: a `QuantWeight`'s
    `desc`, or `panels_desc` of weights packed by `pack_weight`), in one C call:
    the kernels the layer-by-layer forward runs (`add_rms_norm`, `gemm`/`qgemm`, `rope_write_kv`,
    `decode_attention`, `silu_mul`), in its order, with no Python between them, so the same
    bits. `stack.layers[l]` holds layer l's tensors' `data_ptr()`s in `STACK_POINTERS`
    order. x is updated in place. With `prompt`, the products and the attention are those
    of the prompt pass (`NativeStack.prompt_kv_dtype`). With `num_layers` (1 <= n <= the
    stack's layers), only layers [0, n) run and the result is the last one's MLP output,
    x the stream before it is added: the layer loop's (residual, delta) after layer n - 1,
    for the caller's next layer."""
    rows, shape = x.shape[0], stack.shape
    if not (x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == shape.hidden):
        raise ValueError(f"decoder_stack: x must be [T, {shape.hidden}] float32 contiguous")
    total = stack.layers.shape[0]
    if num_layers is not None and not 1 <= num_layers <= total:
        raise ValueError(f"decoder_stack: num_layers must be in [1, {total}], not {num_layers}")
    out = torch.empty(rows, shape.hidden, dtype=torch.float32)
    rc = loaded().plait_decoder_stack(
        total if num_layers is None else num_layers, stack.layers.data_ptr(), rows,
        shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate,
        shape.eps, None if num_layers is not None else stack.final_norm.data_ptr(),
        x.data_ptr(), stack.cos_sin.data_ptr(),
        positions.data_ptr(), slot_mapping.data_ptr(),
        stack.prompt_kv_dtype if prompt else stack.kv_dtype, stack.block_size,
        block_tables.data_ptr(), block_tables.stride(0), chunk_shared.shape[0],
        chunk_start.data_ptr(), chunk_shared.data_ptr(), q_rows.data_ptr(),
        table_rows.data_ptr(), ctx_lens.data_ptr(), stack.scale, out.data_ptr())
    check_rc(rc, "decoder_stack")
    return out




@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer's parts as the stack reads them. A projection is its product
    row's `StackWeight` (None: the row has none); `extra_bias`: a projection besides q|k|v
    has a bias (the C takes none)."""

    input_norm: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor | None  # [hidden]
    qkv: StackWeight | None
    qkv_bias: torch.Tensor | None  # [(H + 2 H_kv) D]
    o: StackWeight | None
    gate_up: StackWeight | None
    down: StackWeight | None
    extra_bias: bool
    k_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor
    k_offset: torch.Tensor | None = None  # [H_kv, D] subtracted from stored keys


def _dense(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.float32 and t.device.type == "cpu" \
        and t.is_contiguous()


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _layer_row(layer: StackLayer) -> tuple[list[int], list[torch.Tensor]] | None:
    """The layer's addresses in STACK_POINTERS order and the tensors they point into, or
    None when the C cannot take it."""
    weights = (layer.qkv, layer.o, layer.gate_up, layer.down)
    if any(w is None for w in weights) or layer.extra_bias \
            or not (_dense(layer.input_norm) and _dense(layer.post_norm)) \
            or not native.kv_caches_fit(layer.k_cache, layer.v_cache) \
            or (layer.qkv_bias is not None and not _dense(layer.qkv_bias)) \
            or (layer.k_offset is not None and not _dense(layer.k_offset)):
        return None
    qkv, o, gate_up, down = (w.desc for w in weights if w is not None)
    named: dict[str, torch.Tensor | None] = {
        "input_norm": layer.input_norm, "qkv_weight": qkv, "qkv_bias": layer.qkv_bias,
        "o_weight": o, "post_norm": layer.post_norm, "gate_up_weight": gate_up,
        "down_weight": down, "k_cache": layer.k_cache, "v_cache": layer.v_cache,
        "k_offset": layer.k_offset}
    held = [t for w in weights if w is not None for t in w.tensors]
    held += [t for t in named.values() if t is not None]
    return [_address(named[n]) for n in STACK_POINTERS], held


def gather_stack(layers: list[StackLayer], shape: StackShape, final_norm: torch.Tensor,
                 cos_sin: torch.Tensor, scale: float,
                 compute_dtype: torch.dtype) -> NativeStack | None:
    """The stack over `layers` (one Llama decoder layer each; the caller checked the
    model's shape fits, see `NativeStack`), or None when a layer, the final norm or the
    RoPE table does not fit the C. `compute_dtype`: the attention's, for the caches' kv
    dtype code."""
    rows: list[list[int]] = []
    tensors: list[torch.Tensor] = []
    any_rows = all(w is not None and w.any_rows for layer in layers
                   for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    for layer in layers:
        row = _layer_row(layer)
        if row is None:
            return None
        rows.append(row[0])
        tensors += row[1]
    if not layers or not _dense(final_norm) or not _dense(cos_sin):
        return None
    k_cache, v_cache = layers[0].k_cache, layers[0].v_cache
    kv_dtype = native.kv_dtype_code(k_cache, v_cache, compute_dtype)
    prompt_kv_dtype = kv_dtype
    if repack.prompt_bf16():
        prompt_kv_dtype |= STACK_PROMPT
        if native.takes_prompt_rows(k_cache, compute_dtype, shape.head_dim):
            prompt_kv_dtype |= native.ATTN_AMX
    return NativeStack(torch.tensor(rows, dtype=torch.int64), shape, final_norm, cos_sin,
                       kv_dtype, prompt_kv_dtype, k_cache.shape[1], scale, tuple(tensors),
                       stack_rows(shape) if any_rows else NATIVE_MAX_ROWS)


def stack_rows(shape: StackShape) -> int:
    """The most rows a stack whose every projection takes any rows (`StackWeight.any_rows`)
    runs a step of: those whose buffers fit STACK_BYTES, and at least NATIVE_MAX_ROWS."""
    q_dim, kv_dim = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    row_floats = 2 * shape.hidden + 2 * q_dim + 2 * kv_dim + 3 * shape.intermediate
    return max(NATIVE_MAX_ROWS, STACK_BYTES // (4 * row_floats))


__all__ = ["STACK_BYTES", "NativeStack", "StackLayer", "StackShape", "decoder_stack",
           "gather_stack", "stack_rows"]
