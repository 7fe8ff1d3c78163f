"""Triton kernel that stores new K/V rows into the paged KV cache.

Same contract as `reference.write_kv_reference`. One program per token copies all of that
token's K/V heads to its slot:

    slot = block_id * block_size + offset_in_block      (-1 = padding, skipped)
    k_cache[block_id, offset_in_block, :, :] = key[token, :, :]

Slots are widened to int64 before any multiplication by a stride: `block_id *
stride(0)` exceeds 2**31 elements once the cache holds more than a few GiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (heads < num_kv_heads) & (dims < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        key_ptr + token * stride_key_t + heads * stride_key_h + dims * stride_key_d, mask=mask
    )
    k_dst = k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_s
    tl.store(
        k_dst + heads * stride_kc_h + dims * stride_kc_d,
        k.to(k_cache_ptr.dtype.element_ty), mask=mask,
    )
    v = tl.load(
        value_ptr + token * stride_value_t + heads * stride_value_h + dims * stride_value_d,
        mask=mask,
    )
    v_dst = v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_s
    tl.store(
        v_dst + heads * stride_vc_h + dims * stride_vc_d,
        v.to(v_cache_ptr.dtype.element_ty), mask=mask,
    )


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be equal [T, H_kv, D], got {key.shape}, {value.shape}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be equal [B, S, H_kv, D], got {k_cache.shape}, {v_cache.shape}"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"cache heads/dim {k_cache.shape[2:]} != key heads/dim {key.shape[1:]}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {slot_mapping.shape}")
    if slot_mapping.is_floating_point() or slot_mapping.is_complex():
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] integer; -1 = padding, not written
) -> None:
    """Store each token's K/V at its slot in place; tokens with slot -1 are skipped.

    Any strides are accepted (e.g. `key` as a view into a fused QKV projection); values
    are cast to the cache dtype. Slots must be < num_blocks * block_size (not checked:
    that would need a host sync). Launches one program per token, no host sync.
    """
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key_ptr=key, value_ptr=value, k_cache_ptr=k_cache, v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        stride_key_t=key.stride(0), stride_key_h=key.stride(1), stride_key_d=key.stride(2),
        stride_value_t=value.stride(0), stride_value_h=value.stride(1),
        stride_value_d=value.stride(2),
        stride_kc_b=k_cache.stride(0), stride_kc_s=k_cache.stride(1),
        stride_kc_h=k_cache.stride(2), stride_kc_d=k_cache.stride(3),
        stride_vc_b=v_cache.stride(0), stride_vc_s=v_cache.stride(1),
        stride_vc_h=v_cache.stride(2), stride_vc_d=v_cache.stride(3),
        num_kv_heads=num_kv_heads, head_dim=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
