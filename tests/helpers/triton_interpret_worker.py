"""Runs the Triton kernels on CPU under TRITON_INTERPRET=1 and saves what they produced.

`tests/kernels/test_kernels_triton.py` starts this module in a subprocess, so the interpreter
flag is set before triton is first imported no matter what the pytest process imported already:

    cd tests && TRITON_INTERPRET=1 python -m helpers.triton_interpret_worker OUT.pt {regular|large}

OUT.pt maps each case name of the group to the kernel's output tensor (a dict of tensors
for the ops-table cases), or to the text of the exception it raised. Cases with block ids
past 2**31 elements run as their own group: an int32 overflow there is a wild pointer, and
the segfault should fail only those cases.
The case tables live here; the test module rebuilds the same seeded inputs and checks the
outputs against the reference.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

from helpers.kernel_cases import (
    LARGE_FIRST_BLOCK_ID,
    MIXED_SEQS,
    BatchSpec,
    build_batch,
    build_write_case,
)

# name -> (batch, num_splits override or None for the launcher's default)
ATTENTION_CASES: dict[str, tuple[BatchSpec, int | None]] = {
    **{
        f"mixed_bs{bs}_group{group}": (
            BatchSpec(MIXED_SEQS, num_heads=2 * group, block_size=bs, seed=bs + group), None
        )
        for bs in (1, 8, 16, 32)
        for group in (1, 3, 4)
    },
    "decode_only": (BatchSpec(((1, 5), (1, 17), (1, 33), (1, 16)), block_size=8), None),
    "prefill_only": (BatchSpec(((33, 33), (16, 16), (1, 1))), None),
    "head_dim_128": (BatchSpec(MIXED_SEQS, num_heads=8, head_dim=128), None),
    "fp16": (BatchSpec(MIXED_SEQS, num_heads=8, dtype=torch.float16), None),
    # no bf16 attention case: the interpreter "does not support operations on bfloat16"
    # (Triton debugging guide) and its tl.dot multiplies bf16 bit patterns
    # (triton-lang/triton#11584, closed unfixed). bf16 attention is tested on CUDA only.
    "splits_decode": (BatchSpec(((1, 200), (1, 130), (1, 1), (1, 64)), num_heads=8), 3),
    # (100, 110): queries at positions 58..63 share a tile with keys up to 73, so split 1
    # (keys 64..) has rows that see no key at all (the m = -inf guard)
    "splits_mixed": (BatchSpec(((1, 150), (5, 180), (100, 110)), num_heads=8, block_size=8), 2),
    "nan_garbage": (BatchSpec(MIXED_SEQS, num_heads=8, nan_garbage=True), None),
    "strided_query": (BatchSpec(MIXED_SEQS, num_heads=6, strided_query=True), None),
    "empty_batch": (BatchSpec(()), None),
    "large_block_ids": (
        BatchSpec(
            ((1, 40), (9, 33), (1, 7)), num_heads=2, num_kv_heads=1, head_dim=16,
            dtype=torch.float16, first_block_id=LARGE_FIRST_BLOCK_ID,
        ),
        None,
    ),
}

# name -> (batch, num_splits or None, window, softcap, scale or None for D^-0.5): the
# attention variants (test_kernels_triton.py compares them with float64 dense attention with
# explicit masks); block size 4 and windows that cut blocks, key tiles and splits
VARIANT_CASES: dict[str, tuple[BatchSpec, int | None, int, float, float | None]] = {
    "variant_window": (BatchSpec(MIXED_SEQS, num_heads=6, block_size=4, seed=31), None, 7,
                       0.0, None),
    "variant_softcap": (BatchSpec(MIXED_SEQS, num_heads=6, block_size=4, seed=32), None, 0,
                        1.5, None),
    "variant_both": (BatchSpec(MIXED_SEQS, num_heads=8, block_size=16, seed=33), None, 11,
                     2.0, None),
    "variant_scale": (BatchSpec(MIXED_SEQS, num_heads=4, block_size=8, seed=34), None, 0, 0.0,
                      0.37),
    # a prefill of 100 queries: key tiles wholly before a tile's first window are skipped
    "variant_long_prefill_window": (BatchSpec(((100, 130), (1, 90)), num_heads=4,
                                              block_size=8, seed=35), None, 20, 0.0, None),
    # flash decoding with a window: whole splits fall before the window (empty, weight 0)
    "variant_splits_window": (BatchSpec(((1, 200), (1, 130), (1, 1), (1, 64)), num_heads=8,
                                        seed=36), 3, 50, 1.5, 0.25),
    # n sequences sharing a prompt longer than the window (the Triton kernel has no shared
    # path: each attends its own table, which points at the same blocks)
    "variant_shared_prompt": (BatchSpec(((1, 37), (1, 33), (1, 40), (1, 45)), num_heads=6,
                                        block_size=4, seed=37), None, 7, 1.5, None),
    "variant_fp16": (BatchSpec(MIXED_SEQS, num_heads=8, dtype=torch.float16, seed=38), None,
                     9, 2.0, None),
}

# name -> keyword arguments of kernel_cases.build_write_case
WRITE_CASES: dict[str, dict] = {
    "write_fp32_to_fp16_dim48": dict(
        num_tokens=13, num_kv_heads=2, head_dim=48, block_size=8, cache_dtype=torch.float16
    ),
    "write_fp32_to_bf16": dict(  # bf16-exact inputs: the interpreter truncates the cast
        num_tokens=7, num_kv_heads=2, head_dim=32, block_size=4, cache_dtype=torch.bfloat16,
        exact_in_cache_dtype=True,
    ),
    "write_block_size_1": dict(
        num_tokens=9, num_kv_heads=3, head_dim=16, block_size=1, cache_dtype=torch.float32
    ),
    "write_large_block_ids": dict(
        num_tokens=10, num_kv_heads=1, head_dim=16, block_size=16,
        cache_dtype=torch.float16, first_block_id=LARGE_FIRST_BLOCK_ID,
    ),
}

# name -> batch whose query tokens get new K/V written, then attend, through the ops table
# `select_ops` picks for CUDA (`TritonOps`, run here on CPU tensors by the interpreter); the
# test compares with the plain reference table (`ops_step`)
OPS_CASES: dict[str, BatchSpec] = {
    "ops_triton_fp32": BatchSpec(MIXED_SEQS, num_heads=6, block_size=8, seed=21),
    "ops_triton_fp16": BatchSpec(MIXED_SEQS, num_heads=8, dtype=torch.float16, seed=22),
}

# name -> (batch, ops_step's variant keywords): the same through the ops table with a
# layer's variants: a window and softcap, a partial RoPE table (24 of 32 dims), a NoPE
# layer (write_kv only)
OPS_VARIANT_CASES: dict[str, tuple[BatchSpec, dict]] = {
    "ops_triton_variants": (BatchSpec(MIXED_SEQS, num_heads=6, head_dim=32, block_size=4,
                                      seed=23), dict(window=6, softcap=1.5, rope_dim=24)),
    "ops_triton_nope": (BatchSpec(MIXED_SEQS, num_heads=4, head_dim=32, block_size=8,
                                  seed=24), dict(window=9, rope_dim=0)),
}

# name -> (batch, which argument to break); each must raise ValueError in the launcher
ERROR_CASES: dict[str, tuple[BatchSpec, str]] = {
    "head_dim_not_power_of_two": (BatchSpec(((1, 4),), head_dim=48), "none"),
    "heads_not_multiple_of_kv_heads": (BatchSpec(((1, 4),), num_heads=3), "none"),
    "query_dtype_differs_from_cache": (BatchSpec(((1, 4),)), "query_dtype"),
    "block_tables_rows_mismatch": (BatchSpec(((1, 4),)), "block_tables"),
}


def _run_attention(spec: BatchSpec, num_splits: int | None) -> torch.Tensor:
    from plait.kernels.cuda.attention import paged_attention_triton

    batch = build_batch(spec)
    return paged_attention_triton(**batch.kernel_args(), num_splits=num_splits)


def _run_variant(spec: BatchSpec, num_splits: int | None, window: int, softcap: float,
                 scale: float | None) -> torch.Tensor:
    from plait.kernels.cuda.attention import paged_attention_triton

    args = build_batch(spec).kernel_args()
    if scale is not None:
        args["scale"] = scale
    return paged_attention_triton(**args, num_splits=num_splits, window=window,
                                  softcap=softcap)


def _run_write(kwargs: dict) -> torch.Tensor:
    """[2, ...] the caches after the write; for huge caches only the written rows."""
    from plait.kernels.cuda.write_kv import write_kv_triton

    inputs = build_write_case(**kwargs)
    write_kv_triton(**inputs)
    k_cache, v_cache, slots = inputs["k_cache"], inputs["v_cache"], inputs["slot_mapping"]
    if kwargs.get("first_block_id", 0) == 0:
        return torch.stack([k_cache, v_cache])
    rows = slots[slots >= 0]
    return torch.stack([c.view(-1, *c.shape[2:])[rows] for c in (k_cache, v_cache)])


def ops_step(spec: BatchSpec, ops, device: str = "cpu", window: int = 0, softcap: float = 0.0,
             rope_dim: int | None = None) -> dict[str, torch.Tensor]:
    """One attention layer of `spec`'s batch through the ops table `ops`, as the model
    runs it: `plan`, then `rope_write_kv` (RoPE, and new seeded K/V for every query token
    written at its slot with the table's `write_kv`), then `attention` over the written
    cache with the layer's `window` and `softcap`. `rope_dim`: the RoPE table's width (None:
    the head size; 0: a NoPE layer, `write_kv` alone, q unrotated). The inputs are built on
    the CPU and moved to `device`. Returns the attention output and both caches after the
    write (on `device`)."""
    from plait.engine.models.rope import rope_cos_sin
    from plait.kernels.metadata import AttentionMetadata

    batch = build_batch(spec)
    bs, h_kv, dim = spec.block_size, spec.num_kv_heads, spec.head_dim
    num_q = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).long()  # [S]
    ctx = batch.context_lens.long()  # [S]
    seq = torch.repeat_interleave(torch.arange(num_q.shape[0]), num_q)  # [T]
    positions = ctx[seq] - num_q[seq] + (  # [T] each query token's position
        torch.arange(seq.shape[0]) - batch.cu_seqlens_q[:-1].long()[seq])
    slots = batch.block_tables[seq, positions // bs].long() * bs + positions % bs  # [T]
    gen = torch.Generator().manual_seed(spec.seed + 1)
    key = torch.randn(seq.shape[0], h_kv, dim, generator=gen).to(spec.dtype)
    value = torch.randn(seq.shape[0], h_kv, dim, generator=gen).to(spec.dtype)
    cos_sin = rope_cos_sin(rope_dim or dim, batch.max_context_len, 10000.0, None)
    query, k_cache, v_cache, cu, ctx_lens, tables, positions, slots, key, value, cos_sin = (
        t.to(device) for t in (batch.query, batch.k_cache, batch.v_cache, batch.cu_seqlens_q,
                               batch.context_lens, batch.block_tables, positions, slots, key,
                               value, cos_sin))
    meta = AttentionMetadata(slots, cu, ctx_lens, tables, batch.max_query_len,
                             batch.max_context_len)
    meta = ops.plan(meta, positions)
    if rope_dim == 0:
        q = query
        ops.write_kv(key, value, k_cache, v_cache, slots)
    else:
        q = ops.rope_write_kv(query, key, value, cos_sin, positions, k_cache, v_cache, slots)
    out = ops.attention(q, k_cache, v_cache, meta, batch.scale, window=window, softcap=softcap)
    return {"attention": out, "k_cache": k_cache, "v_cache": v_cache}


def _run_ops(spec: BatchSpec, variants: dict | None = None) -> dict[str, torch.Tensor]:
    from plait.kernels.ops import AttentionShape, TritonOps, select_ops

    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size)
    ops = select_ops(torch.device("cuda"), spec.dtype, shape)  # what a CUDA engine gets
    if not isinstance(ops, TritonOps):
        raise TypeError(f"select_ops chose {type(ops).__name__} for CUDA, not TritonOps")
    return ops_step(spec, ops, **(variants or {}))


def _run_error(spec: BatchSpec, broken: str) -> torch.Tensor:
    from plait.kernels.cuda.attention import paged_attention_triton

    args = build_batch(spec).kernel_args()
    if broken == "query_dtype":
        args["query"] = args["query"].half()
    elif broken == "block_tables":
        args["block_tables"] = args["block_tables"].repeat(2, 1)
    return paged_attention_triton(**args)


def case_group(name: str) -> str:
    """"large" for the cases whose cache addresses pass 2**31 elements, else "regular"."""
    return "large" if "large" in name else "regular"


def main(out_path: str, group: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 and before anything imports triton")
    jobs = {name: (_run_attention, case) for name, case in ATTENTION_CASES.items()}
    jobs |= {name: (_run_write, (case,)) for name, case in WRITE_CASES.items()}
    jobs |= {name: (_run_variant, case) for name, case in VARIANT_CASES.items()}
    jobs |= {name: (_run_ops, (spec,)) for name, spec in OPS_CASES.items()}
    jobs |= {name: (_run_ops, case) for name, case in OPS_VARIANT_CASES.items()}
    jobs |= {name: (_run_error, case) for name, case in ERROR_CASES.items()}
    results: dict[str, torch.Tensor | dict[str, torch.Tensor] | str] = {}
    for name, (fn, args) in jobs.items():
        if case_group(name) != group:
            continue
        try:
            results[name] = fn(*args)
        except Exception as exc:  # recorded per case so one failure hides no other
            results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
