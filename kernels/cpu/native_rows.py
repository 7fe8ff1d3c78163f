"""The native row-wise kernels (rowwise.c): a layer's small per-row operations, one pass
each (`rope_write_kv`, `add_rms_norm`, `silu_mul`), and the sampler's draw
(`sample_inverse_cdf`).

Every function raises RuntimeError when the kernels are not available (`build.available()`).
"""

from __future__ import annotations

import torch

from plait.kernels.cpu.build import available, check_rc, loaded
from plait.kernels.cpu.native_attn import KV_DTYPES, kv_caches_fit


def rope_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> bool:
    """Whether `rope_write_kv` takes these tensors (float32 CPU, heads and dims dense, the
    caches contiguous, both float32 or both bfloat16) and the kernels are available."""
    return (available() and q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == "cpu" and kv_caches_fit(k_cache, v_cache)
            and q.shape[-1] % 2 == 0
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v)))


def rope_write_kv(
    q: torch.Tensor,  # [T, H, D] float32, rotated in place; rows may be strided
    k: torch.Tensor,  # [T, H_kv, D] float32
    v: torch.Tensor,  # [T, H_kv, D] float32
    cos_sin: torch.Tensor,  # [max_positions, R] float32: cos | sin halves, R even <= D
    positions: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] float32 or bf16 contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] as k_cache
    slot_mapping: torch.Tensor,  # [T] int64, -1 = not written
    k_offset: torch.Tensor | None = None,  # [H_kv, D] float32, subtracted from stored keys
) -> torch.Tensor:  # q
    """`apply_rope` (neox style, over the first R dims of each head: partial rotary when
    R < D, the rest passed through) of q in place and of k, then `write_kv` of the rotated k
    (less `k_offset` where given) and of v, in one pass over the step's tokens; the same
    bits as the plain-torch path (into a bfloat16 cache: the float32 values rounded to
    nearest even, as `.to(torch.bfloat16)`)."""
    if not rope_fits(q, k, v, k_cache, v_cache):
        raise ValueError("rope_write_kv: tensors do not fit (see rope_fits)")
    if k_offset is not None and (k_offset.dtype != torch.float32 or k_offset.device.type
                                 != "cpu" or k_offset.shape != k.shape[1:]
                                 or not k_offset.is_contiguous()):
        raise ValueError(f"rope_write_kv: a key offset of {tuple(k_offset.shape)} "
                         f"{k_offset.dtype} for keys of {tuple(k.shape[1:])}: it must be "
                         "a contiguous float32 CPU tensor of the keys' [H_kv, D]")
    rot = cos_sin.shape[-1]
    if rot % 2 or not 0 < rot <= q.shape[2]:
        raise ValueError(f"rope_write_kv: a RoPE table of width {rot} for heads of "
                         f"{q.shape[2]}: the width must be even, > 0 and <= the head size")
    positions = positions.to(torch.int64).contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    cos_sin = cos_sin.contiguous()
    check_rc(loaded().plait_rope_write_kv(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        q.shape[0], q.shape[1], k.shape[1], q.shape[2], rot, cos_sin.data_ptr(),
        positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        KV_DTYPES[k_cache.dtype], slot_mapping.data_ptr(),
        None if k_offset is None else k_offset.data_ptr()), "rope_write_kv")
    return q


def sample_inverse_cdf(
    logits: torch.Tensor,  # [R, V] float32 CPU, unit stride along V (masked = -inf)
    u: torch.Tensor,  # [R] or [R, 1] float32 in [0, 1)
) -> torch.Tensor:  # [R] int64
    """The token of each row whose cumulative weight first exceeds u times the row's total,
    weights exp(logit - max): `sampler._inverse_cdf` in one pass per row, the rows in
    parallel (C: plait_sample_inverse_cdf)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        raise ValueError("sample_inverse_cdf: logits must be [R, V] float32 on the CPU")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    u = u.reshape(rows).to(torch.float32).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    scratch = torch.empty(rows, vocab, dtype=torch.float32)
    check_rc(loaded().plait_sample_inverse_cdf(logits.data_ptr(), rows, vocab, logits.stride(0),
                                             u.data_ptr(), scratch.data_ptr(), out.data_ptr()),
           "sample_inverse_cdf")
    return out


def rows_fit(*tensors: torch.Tensor,
             dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the row-wise kernels (`add_rms_norm`, `silu_mul`) take these [T, D] tensors:
    one of `dtypes` on the CPU, unit stride along D, and the kernels available."""
    return available() and all(t.dtype in dtypes and t.device.type == "cpu"
                               and t.dim() == 2 and t.stride(1) == 1 for t in tensors)


def add_rms_norm(
    x: torch.Tensor,  # [T, D] float32, unit stride along D
    add: torch.Tensor | None,  # [T, D] float32, unit stride along D; None: nothing added
    weight: torch.Tensor,  # [D] float32
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + add, or x itself), normalized: [T, D] each
    """RMS normalization of x + add in one pass per row (the residual add fused): returns
    the sum (the residual stream) and sum * weight / sqrt(mean(sum^2) + eps)."""
    if not rows_fit(x, *(() if add is None else (add,))) or weight.dtype != torch.float32:
        raise ValueError("add_rms_norm: tensors do not fit (see rows_fit)")
    rows, dim = x.shape
    weight = weight.contiguous()
    total = x if add is None else torch.empty(rows, dim, dtype=torch.float32)
    out = torch.empty(rows, dim, dtype=torch.float32)
    check_rc(loaded().plait_add_rms_norm(
        x.data_ptr(), x.stride(0), None if add is None else add.data_ptr(),
        0 if add is None else add.stride(0), weight.data_ptr(), rows, dim, eps,
        None if add is None else total.data_ptr(), out.data_ptr()), "add_rms_norm")
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """silu(gate) * up of a fused gate|up projection's output, in one pass. float32 in,
    float32 out; bfloat16 in, bfloat16 out (float32 arithmetic on the widened values, the
    result rounded to nearest even: `silu_mul(gate_up.float()).bfloat16()`, bit for bit)."""
    bf16 = gate_up.dtype == torch.bfloat16
    if not rows_fit(gate_up, dtypes=(torch.float32, torch.bfloat16)) or gate_up.shape[1] % 2:
        raise ValueError("silu_mul: gate_up must be [T, 2 I] float32 or bfloat16 with unit "
                         "stride")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    kernel = loaded().plait_silu_mul_bf16 if bf16 else loaded().plait_silu_mul
    check_rc(kernel(gate_up.data_ptr(), gate_up.stride(0), rows, inter, out.data_ptr()),
           "silu_mul")
    return out


__all__ = ["add_rms_norm", "rope_fits", "rope_write_kv", "rows_fit", "sample_inverse_cdf",
           "silu_mul"]
