"""Paged causal attention in Triton, FlashAttention style.

One kernel serves every row kind of a step: a fresh prefill, a prefill chunk after a cached
prefix, a decode token and a run of speculative draft tokens are all "the last ``q_len``
tokens of a sequence of ``seq_len`` tokens", which is the contract of ``stencil.kernels.attention_backend``.

Work split (grid ``[num_tokens // BLOCK_Q + num_seqs, num_kv_heads]``): a program owns up to
``BLOCK_Q`` consecutive query tokens of one sequence and *all* query heads that share one KV
head (grouped-query attention), so every K/V tile it loads is reused by the whole group. Its
``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows walk the sequence's keys in tiles of ``BLOCK_N``
positions, each key found through the block table, and keep a running row maximum, a running
row sum and an fp32 accumulator (the online softmax), so the ``[rows, seq_len]`` score matrix
never exists. Programs past the end of their sequence's queries return at once; the grid's
first axis is an upper bound (sequence ``i``'s tiles start at
``query_start_loc[i] // BLOCK_Q + i``) so it needs no host-side scan.

Sources: FlashAttention-2 (Dao 2023, arXiv 2307.08691) for the tiling and the online
softmax (Milakov & Gimelshein 2018, arXiv 1805.02867); PagedAttention (Kwon et al. 2023,
arXiv 2309.06180) for the block table; grouped-query attention (Ainslie et al. 2023, arXiv
2305.13245); Triton's documented ``tl.dot`` / ``input_precision`` semantics.

Importing this module imports ``triton``; ``stencil.kernels.triton.backend`` imports it lazily.
Under the Triton interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is first imported)
the same kernel runs on CPU tensors; the interpreter cannot compute on bfloat16 (it stores
it as raw ``uint16``), so interpreted bf16 launches upcast Q/K/V to fp32 inside the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stencil.kernels.attention_backend import AttentionMetadata
from stencil.kernels.triton.launch import check_launchable, is_interpreted

_LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    query_start_loc_ptr,  # int32 [B + 1]
    seq_lens_ptr,  # int32 [B]
    block_tables_ptr,  # int32 [B, max_blocks]
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    num_seqs,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # key positions per tile
    SEQS_PAD: tl.constexpr,  # num_seqs rounded up to a power of two
    UPCAST: tl.constexpr,  # load bf16 as fp32 (the interpreter cannot compute on bf16)
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs out of TF32
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Which sequence owns this program: count the sequences whose first tile starts at or
    # before pid (tile starts strictly increase, so the count minus one is the owner).
    seq_idx = tl.arange(0, SEQS_PAD)
    seq_ok = seq_idx < num_seqs
    starts = tl.load(query_start_loc_ptr + seq_idx, mask=seq_ok, other=0)
    tile_starts = starts // BLOCK_Q + seq_idx
    seq = tl.sum((seq_ok & (tile_starts <= pid)).to(tl.int32), axis=0) - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    context_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP_PAD  # query token index within the sequence
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    # Rows past q_len get positions >= seq_len: they still see key 0, so no row is ever
    # fully masked and the running max stays finite (their output is not stored).
    q_pos = context_len + tok

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys this tile needs: up to the position of its last valid query token.
    last_tok = tl.minimum((tile + 1) * BLOCK_Q, q_len)
    kv_end = context_len + last_tok
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for kv_start in range(0, kv_end, BLOCK_N):
        pos = kv_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        k_offs = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_offs = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_offs[None, :] + dims[:, None],
                    mask=pos_ok[None, :] & dim_ok[:, None], other=0.0)  # [D, BLOCK_N]
        v = tl.load(v_cache_ptr + v_offs[:, None] + dims[None, :],
                    mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, D]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def launch_config(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    num_seqs: int,
    *,
    interpreted: bool = False,
    block_q_rows: int | None = None,
    block_n: int | None = None,
) -> dict[str, object]:
    """The kernel's compile-time parameters (``tl.constexpr`` names -> values) for a batch.

    ``block_q_rows`` is the target of rows per program (query tokens x heads of one group):
    16 by default when every query is short (decode, drafts), else 64; ``tl.dot`` needs at
    least 16. ``block_n`` is the key tile (a power of two >= 16): 32 for fp32 (twice the
    registers per element), else 64.
    """
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if block_q_rows is None:
        block_q_rows = 16 if max_query_len * group_pad <= 16 else 64
    block_q = max(block_q_rows // group_pad, triton.cdiv(16, group_pad), 1)
    if block_n is None:
        block_n = 32 if dtype == torch.float32 else 64
    return {
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": block_q,
        "BLOCK_N": block_n,
        "SEQS_PAD": triton.next_power_of_2(max(num_seqs, 1)),
        "UPCAST": interpreted and dtype == torch.bfloat16,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], written in place
    block_q_rows: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], dtype of ``query``
    """Causal attention of each query row over its sequence's paged K/V.

    Query row ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j`` and
    attends to positions ``0..`` that position, read through ``meta.block_tables``
    (``stencil.kernels.attention_backend`` has the full contract). Accumulation is fp32 for fp32, fp16 and bf16
    inputs; fp32 dots use IEEE precision (no TF32).

    Args:
        query: ``[T, num_heads, head_dim]``, last dim contiguous; fp32, fp16 or bf16.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype as
            ``query``, last dim contiguous.
        meta: the step's metadata (tensors on the same device as ``query``).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional output buffer (for example a slice of a preallocated tensor).
        block_q_rows, block_n: tile sizes, see ``launch_config``.

    Returns:
        ``out`` (allocated when not given).

    Raises:
        ValueError: shapes, dtypes or strides that the kernel cannot serve.
        RuntimeError: CPU tensors while the interpreter is off (set ``TRITON_INTERPRET=1``
            before ``triton`` is imported).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit "
                         f"query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (query.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes differ: query {query.dtype}, k_cache {k_cache.dtype}, "
                         f"v_cache {v_cache.dtype}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {query.dtype}")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, strides {t.stride()}")
    if meta.block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables needs a contiguous last dimension, "
                         f"strides {meta.block_tables.stride()}")
    if num_tokens != meta.num_tokens:
        raise ValueError(f"query has {num_tokens} rows, metadata {meta.num_tokens}")
    check_launchable(_paged_attention_kernel, query)
    interpreted = is_interpreted(_paged_attention_kernel)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out

    config = launch_config(query.dtype, num_heads, num_kv_heads, head_dim, block_size,
                           meta.max_query_len, meta.num_seqs, interpreted=interpreted,
                           block_q_rows=block_q_rows, block_n=block_n)
    num_seqs = meta.num_seqs
    grid = (num_tokens // config["BLOCK_Q"] + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * _LOG2_E, num_seqs,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        **config,
    )
    return out


__all__ = ["launch_config", "paged_attention"]
