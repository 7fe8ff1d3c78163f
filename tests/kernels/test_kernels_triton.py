"""Triton kernels against the plain-torch reference.

On CPU the kernels run under the Triton interpreter in one subprocess
(`triton_interpret_worker.py`, started once per module): TRITON_INTERPRET must be set
before triton is imported, which this pytest process cannot promise. Each case's output
is compared here, in the parent, with the reference on the same seeded inputs. The
`cuda` tests run the compiled kernels in-process on larger shapes.

The ops-table cases (`OPS_CASES`) run a layer's KV write and attention through the table
`select_ops` picks for CUDA (`TritonOps`), which the interpreter runs on CPU tensors, and
compare with the plain reference table (`TorchOps` without cascade).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from helpers.kernel_cases import (
    MIXED_SEQS,
    BatchSpec,
    build_batch,
    build_write_case,
    dense_attention,
)
from helpers.paths import SCRIPTS, TESTS
from helpers.triton_interpret_worker import (
    ATTENTION_CASES,
    ERROR_CASES,
    OPS_CASES,
    OPS_VARIANT_CASES,
    VARIANT_CASES,
    WRITE_CASES,
    case_group,
    ops_step,
)

from plait.kernels.ops import AttentionShape, TorchOps, TritonOps, select_ops
from plait.kernels.reference import paged_attention_reference, write_kv_reference

BENCH_DECODE = SCRIPTS / "bench_decode.py"
# (atol, rtol) against the reference, which computes in fp32 and rounds once at the end
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),  # P is rounded to fp16 before the P @ V dot
    torch.bfloat16: (3e-2, 2e-2),  # likewise in bf16 (8 mantissa bits)
}
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU: torch.cuda.is_available() is False"
)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Outputs of every worker case: one TRITON_INTERPRET=1 subprocess per case group.

    A group whose worker dies (e.g. a segfault from an overflowed address) maps each of
    its cases to the crash report, so exactly those cases fail.
    """
    results = {}
    for group in ("regular", "large"):
        out_path = tmp_path_factory.mktemp("triton_interpret") / f"{group}.pt"
        proc = subprocess.run(
            [sys.executable, "-m", "helpers.triton_interpret_worker", str(out_path), group],
            cwd=TESTS, env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True, text=True, timeout=600, check=False,
        )
        if proc.returncode == 0:
            results |= torch.load(out_path, weights_only=True)
            continue
        crash = f"worker crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        names = [*ATTENTION_CASES, *VARIANT_CASES, *WRITE_CASES, *OPS_CASES,
                 *OPS_VARIANT_CASES, *ERROR_CASES]
        results |= {name: crash for name in names if case_group(name) == group}
    return results


def _result(interpreted: dict, name: str) -> torch.Tensor:
    result = interpreted[name]
    assert isinstance(result, torch.Tensor), result
    return result


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_interpreted_attention_matches_reference(interpreted, name):
    spec, _ = ATTENTION_CASES[name]
    batch = build_batch(spec)
    got = _result(interpreted, name)
    if spec.nan_garbage or spec.first_block_id:
        # the reference's decode path reads unused slots and block 0 (NaN garbage, or
        # never-written memory here): compare with dense attention instead
        expected = dense_attention(batch).to(spec.dtype)
    else:
        expected = paged_attention_reference(**batch.kernel_args())
    atol, rtol = TOLERANCES[spec.dtype]
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def test_interpreted_attention_would_catch_wrong_causal_offset(interpreted):
    """The tolerance is tight enough that attending one key too many (or few) fails."""
    spec, _ = ATTENTION_CASES["mixed_bs16_group4"]
    batch = build_batch(spec)
    got = _result(interpreted, "mixed_bs16_group4").double()
    atol, rtol = TOLERANCES[spec.dtype]
    torch.testing.assert_close(got, dense_attention(batch), atol=atol, rtol=rtol)
    for shift in (1, -1):
        wrong = dense_attention(batch, causal_shift=shift)
        assert not torch.allclose(got, wrong, atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_interpreted_attention_variants_match_dense(interpreted, name):
    """A sliding window, a logit softcap, both, a custom scale: the kernel against float64
    dense attention with explicit masks (`dense_attention`), which the variant changes by
    far more than the tolerance."""
    spec, _, window, softcap, scale = VARIANT_CASES[name]
    batch = build_batch(spec)
    plain = dense_attention(batch)
    if scale is not None:
        batch.scale = scale
    expected = dense_attention(batch, window=window, softcap=softcap)
    got = _result(interpreted, name)
    atol, rtol = TOLERANCES[spec.dtype]
    assert got.shape == expected.shape and got.dtype == spec.dtype
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
    assert (plain - expected).abs().max() > 100 * atol


@pytest.mark.parametrize("name", list(OPS_VARIANT_CASES))
def test_interpreted_triton_ops_variants_match_the_reference_ops(interpreted, name):
    """`TritonOps` with a layer's variants (a window and softcap with a partial RoPE table;
    a NoPE layer's `write_kv`) against the reference table: caches bit for bit, attention
    within tolerance."""
    spec, variants = OPS_VARIANT_CASES[name]
    got = interpreted[name]
    assert isinstance(got, dict), got
    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size)
    expected = ops_step(spec, TorchOps(shape, cascade=False), **variants)
    assert torch.equal(got["k_cache"], expected["k_cache"])
    assert torch.equal(got["v_cache"], expected["v_cache"])
    atol, rtol = TOLERANCES[spec.dtype]
    torch.testing.assert_close(got["attention"], expected["attention"], atol=atol, rtol=rtol)
    # the variants matter: the same step without them is another result
    plain = ops_step(spec, TorchOps(shape, cascade=False))
    assert not torch.allclose(plain["attention"], expected["attention"], atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_interpreted_write_kv_matches_direct_indexing(interpreted, name):
    inputs = build_write_case(**WRITE_CASES[name])
    slots, key, value = inputs["slot_mapping"], inputs["key"], inputs["value"]
    valid = slots >= 0
    got = _result(interpreted, name)
    if WRITE_CASES[name].get("first_block_id", 0):  # worker returned only the written rows
        dtype = inputs["k_cache"].dtype
        expected = torch.stack([key[valid].to(dtype), value[valid].to(dtype)])
    else:
        expected = torch.stack([inputs["k_cache"], inputs["v_cache"]]).clone()
        for cache, new in zip(expected, (key, value), strict=True):
            cache.view(-1, *cache.shape[2:])[slots[valid]] = new[valid].to(cache.dtype)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", list(OPS_CASES))
def test_interpreted_triton_ops_match_the_reference_ops(interpreted, name):
    """`TritonOps.rope_write_kv` (its `write_kv`) and `.attention`, as a CUDA engine calls
    them, against the reference table on the same step: the caches bit for bit, the
    attention within the kernel's tolerance."""
    spec = OPS_CASES[name]
    got = interpreted[name]
    assert isinstance(got, dict), got
    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size)
    expected = ops_step(spec, TorchOps(shape, cascade=False))
    assert torch.equal(got["k_cache"], expected["k_cache"])
    assert torch.equal(got["v_cache"], expected["v_cache"])
    # the write changed the cache: the query tokens attend their new K/V
    assert not torch.equal(expected["k_cache"], build_batch(spec).k_cache)
    out, ref = got["attention"], expected["attention"]
    atol, rtol = TOLERANCES[spec.dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype == spec.dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_interpreted_launcher_rejects_bad_input(interpreted, name):
    assert isinstance(interpreted[name], str) and interpreted[name].startswith("ValueError:")


def _cuda_batch(spec: BatchSpec) -> dict:
    args = build_batch(spec).kernel_args()
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(
    "seqs, num_heads, num_kv_heads, head_dim",
    [
        ((*MIXED_SEQS, (300, 700), (1, 2049), (128, 128)), 32, 8, 128),
        (((1, 4000), (1, 33), (1, 1500), (1, 17)), 24, 8, 64),  # decode-only: split path
        (((257, 257), (1, 90), (64, 1000)), 12, 4, 128),
    ],
)
def test_cuda_attention_matches_reference(
    seqs, num_heads, num_kv_heads, head_dim, block_size, dtype
):
    from plait.kernels.cuda.attention import paged_attention_triton

    spec = BatchSpec(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=7)
    args = _cuda_batch(spec)
    expected = paged_attention_reference(**args)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(paged_attention_triton(**args), expected, atol=atol, rtol=rtol)
    split = paged_attention_triton(**args, num_splits=4)
    torch.testing.assert_close(split, expected, atol=atol, rtol=rtol)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(512, 0.0), (0, 50.0), (100, 30.0)])
def test_cuda_attention_variants_match_reference(window, softcap, dtype):
    """Gemma-like variants on the compiled kernel: the reference on the same device, with
    and without flash-decoding splits."""
    from plait.kernels.cuda.attention import paged_attention_triton

    spec = BatchSpec((*MIXED_SEQS, (300, 700), (1, 2049), (1, 1500)), 16, 8, 128, 16, dtype,
                     seed=8)
    args = _cuda_batch(spec)
    args["scale"] = 256**-0.5  # query_pre_attn_scalar 256
    expected = paged_attention_reference(**args, window=window, softcap=softcap)
    atol, rtol = TOLERANCES[dtype]
    for splits in (None, 4):
        got = paged_attention_triton(**args, num_splits=splits, window=window, softcap=softcap)
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("block_size", [1, 16])
def test_cuda_write_kv_matches_reference(block_size):
    from plait.kernels.cuda.write_kv import write_kv_triton

    inputs = build_write_case(300, 8, 128, block_size, torch.bfloat16, seed=3)
    expected = {k: v.clone() for k, v in inputs.items()}
    write_kv_reference(**expected)
    on_gpu = {k: v.cuda() for k, v in inputs.items()}
    write_kv_triton(**on_gpu)
    assert torch.equal(on_gpu["k_cache"].cpu(), expected["k_cache"])
    assert torch.equal(on_gpu["v_cache"].cpu(), expected["v_cache"])


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_ops_table_matches_the_reference_ops(dtype):
    """The table a CUDA engine gets (`select_ops`) against the reference table on the same
    device: the KV write bit for bit, the attention within tolerance."""
    spec = BatchSpec((*MIXED_SEQS, (300, 700), (1, 2049)), num_heads=32, num_kv_heads=8,
                     head_dim=128, block_size=16, dtype=dtype, seed=9)
    shape = AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size)
    ops = select_ops(torch.device("cuda"), dtype, shape)
    assert isinstance(ops, TritonOps)
    got = ops_step(spec, ops, device="cuda")
    expected = ops_step(spec, TorchOps(shape, cascade=False), device="cuda")
    assert torch.equal(got["k_cache"], expected["k_cache"])
    assert torch.equal(got["v_cache"], expected["v_cache"])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got["attention"], expected["attention"], atol=atol, rtol=rtol)


@pytest.mark.cuda
@requires_cuda
def test_cuda_decode_bandwidth_reports_sane_numbers():
    bench_decode = _load_bench_decode()
    result = bench_decode.measure_decode_bandwidth(8, 4096, 32, 8, 128, 16, torch.bfloat16)
    assert result["gbps"] > 0 and result["time_ms"] > 0
    assert bench_decode.measure_copy_bandwidth(1 << 28) > 0


def _load_bench_decode():
    """scripts/bench_decode.py (a script, not in the package), imported from its path."""
    spec = importlib.util.spec_from_file_location("bench_decode_under_test", BENCH_DECODE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_bench_decode_imports_without_cuda_and_refuses_to_run():
    bench_decode = _load_bench_decode()
    with pytest.raises(RuntimeError, match="CUDA"):
        bench_decode.measure_decode_bandwidth(1, 16, 2, 1, 64, 16, torch.float16)
