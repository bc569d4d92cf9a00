"""The ``flash`` attention backend: flash-attn 2 kernels over our paged KV cache (CUDA only).

``flash_attn`` is imported when the backend is constructed, never when this module is, so
CPU machines (and CI) can import ``stencil.kernels.flash`` without it.

The block size constraint. Upstream flash-attn 2 reads a paged cache (``block_table=`` in
``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``) only when the page size is a
multiple of 256 tokens (its C++ entry points check ``page_block_size % 256 == 0``), while
our cache uses ``stencil.kernels.attention_backend.BLOCK_SIZE = 16`` tokens per block so prefix caching and
allocation stay fine-grained. The backend therefore looks at the cache it is given:

* block size a multiple of 256: attention reads the cache in place through the block table,
  with ``flash_attn_with_kvcache`` when every sequence has the same number of query tokens
  (decode, or a fixed number of draft tokens) and ``flash_attn_varlen_func`` otherwise;
* any other block size (the default 16): ``gather_kv`` copies each sequence's K/V out of the
  cache into one contiguous varlen tensor (``index_select`` over the slots, no host sync),
  then ``flash_attn_varlen_func`` runs on it. That costs one extra read and write of the
  batch's K/V per layer, which is why the ``triton`` backend (paged reads at block size 16)
  is the one to prefer for long contexts with this cache.

Both flash-attn entry points align the causal mask to the bottom-right corner (query row
``j`` of a ``q_len``-row sequence of ``seq_len`` keys sees keys ``0..seq_len - q_len + j``),
which is exactly the contract of ``stencil.kernels.attention_backend``. Source: flash-attn 2 docstrings of
``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` (Dao 2023, arXiv 2307.08691).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stencil.kernels.attention_backend import AttentionMetadata

PAGED_BLOCK_MULTIPLE = 256
"""flash-attn 2 reads a paged cache only when its block size is a multiple of this."""


def gather_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy every sequence's K/V (positions ``0..seq_lens[i]-1``) out of the paged cache.

    In a hybrid cache's window group (``stencil.kernels.attention_backend``), positions that fell out of
    every window come from the null block 0: zeros, which the caller's window mask then hides.

    Returns:
        ``(k, v, cu_seqlens_k)``: ``k`` and ``v`` are ``[sum(seq_lens), num_kv_heads,
        head_dim]`` with sequence ``i`` at rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``;
        ``cu_seqlens_k`` is int32 ``[B + 1]``. All on the cache's device; the only host value
        used is ``sum(meta.seq_lens_cpu)``, so no device sync happens.

    Raises:
        ValueError: a non-contiguous cache (its flat slot view would not alias it).
    """
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("gather_kv needs contiguous caches")
    block_size = k_cache.shape[1]
    device = k_cache.device
    total = sum(meta.seq_lens_cpu)
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.int64)
    cu_seqlens = F.pad(torch.cumsum(seq_lens, 0), (1, 0))
    seq_of_key = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), seq_lens,
                                         output_size=total)
    pos = torch.arange(total, device=device) - cu_seqlens[seq_of_key]
    blocks = meta.block_tables.to(device)[seq_of_key, pos // block_size].to(torch.int64)
    slots = blocks * block_size + pos % block_size
    k = k_cache.flatten(0, 1).index_select(0, slots)
    v = v_cache.flatten(0, 1).index_select(0, slots)
    return k, v, cu_seqlens.to(torch.int32)


class FlashAttentionBackend:
    """Paged attention through flash-attn 2 (fp16/bf16 on CUDA); see the module docstring for
    how the cache's block size picks between in-place paged reads and a K/V gather.

    Args:
        device: the engine's device (kept for the registry's uniform constructor).

    Raises:
        RuntimeError: ``flash-attn is not installed`` (or it fails to import).
    """

    name = "flash"

    def __init__(self, device: torch.device | str | None = None) -> None:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:
            raise RuntimeError(f"flash-attn is not installed ({exc})") from exc
        self.device = torch.device(device) if device is not None else None
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T], every slot >= 0
    ) -> None:
        """Write each new token's K and V into its slot (in place), with ``index_copy_``.

        Raises:
            RuntimeError: from torch, for an out-of-range (or negative) slot.
        """
        heads, dim = k_cache.shape[-2:]
        k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of every query row over its sequence's paged K/V (GQA aware).

        ``window`` goes to flash-attn as ``window_size=(window - 1, 0)``: a row sees itself and
        the ``window - 1`` keys before it (flash-attn 2's local attention, bottom-right aligned
        like its causal mask), the rows ``stencil.kernels.attention_backend`` asks for.

        Raises:
            ValueError: a dtype flash-attn does not support (only fp16 and bf16), or ``window`` < 1.
        """
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        local = (-1, -1) if window is None else (window - 1, 0)
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash-attn supports fp16 and bf16, got {query.dtype}; "
                             "use the triton or torch backend for fp32")
        num_tokens, num_heads, head_dim = query.shape
        if k_cache.shape[1] % PAGED_BLOCK_MULTIPLE:
            k, v, cu_seqlens_k = gather_kv(k_cache, v_cache, meta)
            return self._varlen(query, k, v, cu_seqlens_q=meta.query_start_loc,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                                max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                                window_size=local)
        num_seqs = meta.num_seqs
        if num_tokens == num_seqs * meta.max_query_len:
            # Every sequence has max_query_len rows, so the flat batch is a dense
            # [B, q_len] one: the kvcache kernel (split-KV for long contexts) serves it.
            q = query.view(num_seqs, meta.max_query_len, num_heads, head_dim)
            out = self._with_kvcache(q, k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                     block_table=meta.block_tables, softmax_scale=scale,
                                     causal=True, window_size=local)
            return out.view(num_tokens, num_heads, head_dim)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return self._varlen(query, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_query_len,
                            max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                            block_table=meta.block_tables, window_size=local)
