"""Attention kernels over the paged KV cache, dispatched by device.

Public entry points (same signature for every backend):

* `write_kv(key, value, k_cache, v_cache, slot_mapping)` stores new K/V in the cache.
* `paged_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, ...)`
  attends a flattened variable-length batch of queries to the cached K/V.

CUDA tensors use the Triton kernels when triton imports; everything else (CPU, or
`PLAIT_ATTENTION_BACKEND=reference`) uses the plain-torch reference implementations.
"""

from plait.kernels.dispatch import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]
