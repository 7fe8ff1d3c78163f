"""Pick the attention backend by device: Triton on CUDA, plain torch elsewhere."""

from __future__ import annotations

import os

import torch

from plait.kernels.cascade import cascade_attention_reference
from plait.kernels.reference import paged_attention_reference, write_kv_reference


def _use_triton(tensor: torch.Tensor) -> bool:
    if not tensor.is_cuda or os.environ.get("PLAIT_ATTENTION_BACKEND") == "reference":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store new K/V into the paged cache (see `reference.write_kv_reference`)."""
    if _use_triton(key):
        from plait.kernels.triton_write_kv import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    scale: float,
    max_query_len: int,
    max_context_len: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal paged attention (see `reference.paged_attention_reference` for the contract).

    Without Triton, decode rows that share leading blocks use the shared-prefix (cascade)
    reference (`cascade.py`); `PLAIT_CASCADE=0` selects the plain reference instead."""
    args = dict(
        query=query, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens, block_tables=block_tables, scale=scale,
        max_query_len=max_query_len, max_context_len=max_context_len,
    )
    if _use_triton(query):
        from plait.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(**args)
    if os.environ.get("PLAIT_CASCADE", "1") == "0":
        return paged_attention_reference(**args)
    return cascade_attention_reference(**args)
