"""Write new tokens' K and V into their slots of the paged cache, in Triton.

One program per new token copies its ``[num_kv_heads, head_dim]`` key and value rows to slot
``slot_mapping[t]`` = ``block_id * block_size + offset`` (vLLM's slot layout, Kwon et al.
2023, arXiv 2309.06180). A negative slot marks a padding token (for example a batch padded
to a captured CUDA-graph size) and is skipped.

Importing this module imports ``triton``; ``stencil.kernels.triton.backend`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stencil.kernels.triton.launch import check_launchable


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    slot_mapping_ptr,  # int64 [T]
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    """Copy ``key[t]`` / ``value[t]`` into slot ``slot_mapping[t]`` of the caches, in place.

    ``key`` and ``value`` may be strided views (such as slices of a fused QKV projection) as
    long as their last dimension is contiguous. Slots must be distinct and below
    ``num_blocks * block_size``; a negative slot is skipped. Out-of-range slots are not
    checked on the device (that would cost a sync): they write out of bounds.

    Raises:
        ValueError: shapes, dtypes (K/V must match the cache dtype) or strides that do not fit.
        RuntimeError: CPU tensors while the interpreter is off (``stencil.kernels.triton.launch``).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not hold "
                         f"[{num_kv_heads}, {head_dim}] rows")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes differ: key {key.dtype}, value {value.dtype}, "
                         f"caches {k_cache.dtype}/{v_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, strides {t.stride()}")
    check_launchable(_reshape_and_cache_kernel, key)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


__all__ = ["reshape_and_cache"]
