"""Python entry points of Plait's native CPU kernels (the C in this folder), one import for
their callers: the wrappers live in one module per job, each checking its tensors then
making one ctypes call.

    build.py             compiling and loading the library, the ABI parsed from plait_cpu.h,
                         return codes as exceptions (`check_rc`)
    native_gemm.py       products: gemm (float32 panels), qgemm, dequantize
    repack.py            weights repacked at their own bit width, their int8 products
    native_attn.py       paged decode attention, the KV caches' codes and limits
    native_rows.py       rope_write_kv, add_rms_norm, silu_mul, sample_inverse_cdf
    stack.py             the whole decoder stack in one call (decoder.c)

Callers reach the kernels through this module (`native.qgemm(...)`), so a test or a
profiler that replaces one of its attributes sees every call.
"""

from __future__ import annotations

from plait.kernels.cpu.build import MAX_QUERIES, STACK_POINTERS, available, check_rc
from plait.kernels.cpu.native_attn import (
    ATTN_AMX,
    ATTN_BF16_DOT,
    KV_DTYPES,
    decode_attention,
    kv_caches_fit,
    kv_dtype_code,
    max_chunk_rows,
    prompt_attention_amx,
    supports_attention,
    takes_prompt_rows,
)
from plait.kernels.cpu.native_gemm import (
    F32_PANELS,
    QUANT_TYPES,
    dequantize,
    gemm,
    lanes,
    pack_weight,
    panels_desc,
    qgemm,
)
from plait.kernels.cpu.native_rows import (
    add_rms_norm,
    rope_fits,
    rope_write_kv,
    rows_fit,
    sample_inverse_cdf,
    silu_mul,
)

__all__ = ["ATTN_AMX", "ATTN_BF16_DOT", "F32_PANELS", "KV_DTYPES", "MAX_QUERIES", "QUANT_TYPES",
           "STACK_POINTERS", "add_rms_norm", "available", "check_rc", "decode_attention",
           "dequantize", "gemm", "kv_caches_fit", "kv_dtype_code", "lanes", "max_chunk_rows",
           "pack_weight", "panels_desc", "prompt_attention_amx", "qgemm", "rope_fits",
           "rope_write_kv", "rows_fit", "sample_inverse_cdf", "silu_mul", "supports_attention",
           "takes_prompt_rows"]
