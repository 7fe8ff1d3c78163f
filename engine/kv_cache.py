"""The paged KV cache's element type, size and memory: what `ModelRunner` allocates.

    kv_cache: [layers, 2 (k|v), num_blocks, block_size, num_kv_heads, head_dim] of kv_dtype

On CPU it is one mapping (host_memory.kv_zeros) whose 4 KiB pages become resident as blocks
are first written, or all at start (on huge pages) with `kv_cache_prefault`; on CUDA a zeroed
tensor.
"""

from __future__ import annotations

import logging
import os

import torch

from plait.engine.config import EngineConfig
from plait.engine.host_memory import kv_zeros
from plait.engine.model_config import ModelConfig

logger = logging.getLogger("plait.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_dtype(requested: str, dtype: torch.dtype, device: torch.device,
                     auto: torch.dtype | None = None) -> torch.dtype:
    """The KV cache's element type for `EngineConfig.kv_cache_dtype` on an engine of
    `dtype` activations: "auto" is `auto` (the numerics' choice, `Numerics.kv_dtype`) or,
    where that is None, `dtype`; "bfloat16" on the CPU, where every op writes and
    reads a bf16 cache whatever the activations' dtype; on CUDA the Triton kernels keep the
    cache in the model dtype, so "bfloat16" needs a bfloat16 model (ValueError otherwise)."""
    if requested == "auto":
        return dtype if auto is None else auto
    kv_dtype = DTYPES[requested]
    if device.type == "cuda" and kv_dtype != dtype:
        raise ValueError(f"--kv-cache-dtype {requested} on CUDA needs a {requested} model "
                         f"(--dtype auto or {requested}): the CUDA KV cache takes the model "
                         f"dtype, here {str(dtype).removeprefix('torch.')}")
    return kv_dtype


def block_bytes(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes one KV block holds over every layer (K and V, `kv_dtype` elements)."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def blocks_from_memory(config: EngineConfig, device: torch.device, block_bytes: int,
                       weight_bytes: int) -> int:
    """The blocks that fit the memory budget: `kv_cache_memory_gb` on CPU (never past the
    host's memory less the weights), `gpu_memory_utilization` of the device on CUDA.
    ValueError below 2 blocks."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = 2 << 30  # activations, logits and the allocator's slack
        budget = total * config.gpu_memory_utilization - (total - free) - reserve
    else:
        budget = config.kv_cache_memory_gb * (1 << 30)
        # the weights and the cache share host memory: never plan past it
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if weight_bytes + budget > host:
            budget = host - weight_bytes - (1 << 30)
            logger.warning("KV cache cut to %.2f GiB: the weights take %.2f of %.2f GiB",
                           budget / 2**30, weight_bytes / 2**30, host / 2**30)
    num = int(budget // block_bytes)
    if num < 2:
        raise ValueError("not enough memory for the KV cache; lower the model size or "
                         "raise --gpu-memory-utilization / --kv-cache-memory-gb")
    return num


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      kv_dtype: torch.dtype, device: torch.device,
                      prefault: bool = False) -> torch.Tensor:
    """The zeroed cache (module docstring's shape), logged with its size; `prefault`: on
    CPU, resident from the start."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    cache = (kv_zeros(shape, kv_dtype, prefault) if device.type == "cpu"
             else torch.zeros(shape, dtype=kv_dtype, device=device))
    logger.info("KV cache: %d blocks of %d tokens, %s, %.1f MiB%s", num_blocks, block_size,
                str(kv_dtype).removeprefix("torch."), cache.nbytes / 2**20,
                ", resident from the start" if prefault else "")
    return cache


__all__ = ["DTYPES", "allocate_kv_cache", "block_bytes", "blocks_from_memory",
           "resolve_kv_dtype"]
