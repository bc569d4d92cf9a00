"""Reference paged attention in plain torch (CPU and any other device torch runs on).

Semantics are those of ``stencil.kernels.attention_backend`` (flat batch, paged K/V, causal over the cached prefix
plus the new tokens). Two paths:

* a sequence with up to ``SHORT_QUERY`` query tokens behind its cached prefix (a decode token,
  grammar-forced tokens, speculative drafts) computes each row on its own: one SDPA call with
  the row's query heads against exactly the keys it sees, no mask (``_rows``). A row's result
  is then the same bits whatever else the step holds: batching, forcing and speculation
  cannot change a greedy output. torch's CPU kernels round differently with the number of
  query rows and of (masked) keys, by ~1e-7, and int4's bf16 activations magnify that into
  flipped tokens (3 of 16 SmolLM2 extraction outputs at concurrency 8 with one padded call
  per step). It costs no more: 8 decode rows over ~350 keys took 0.47 ms per layer this way,
  2.5 ms as one padded, length-masked call;
* other sequences (prefill, a prefill chunk after a cached prefix) run one
  ``scaled_dot_product_attention`` each, with ``is_causal`` when nothing is cached and an
  additive offset-causal mask otherwise.

Attention is computed in fp32 whatever the cache dtype, so this backend is the accuracy
oracle for the faster ones.

Sources: scaled dot-product attention (Vaswani et al. 2017, arXiv 1706.03762); the paged
K/V layout and slot mapping of vLLM (Kwon et al. 2023, arXiv 2309.06180); grouped-query
attention (Ainslie et al. 2023, arXiv 2305.13245).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stencil.kernels.attention_backend import AttentionMetadata


SHORT_QUERY = 16  # up to this many query tokens behind a cached prefix: row by row (``_rows``)


class TorchAttentionBackend:
    """Paged attention by gathering K/V through the block table, then torch SDPA.

    Args:
        device: accepted for the registry's uniform constructor; the backend works on
            whatever device its input tensors live on.
    """

    name = "torch"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        """Write each new token's K and V into slot ``slot_mapping[t]`` of the caches (in place).

        Raises:
            RuntimeError: from torch when a slot is out of range or shapes disagree.
        """
        heads, dim = k_cache.shape[-2:]
        # The caches are contiguous, so the flat view aliases them and index_copy_ writes through.
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
        """Causal attention of every query row over its sequence's K/V (GQA: head ``h`` reads
        kv head ``h // (num_heads // num_kv_heads)``, as transformers' ``repeat_kv``); with
        ``window``, each row sees its last ``window`` positions only (``stencil.kernels.attention_backend``).

        Returns:
            ``[T, num_heads, head_dim]`` in ``query.dtype``.

        Raises:
            ValueError: ``window`` < 1.
        """
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        out = torch.empty_like(query)
        starts = meta.query_start_loc_cpu
        for i in range(meta.num_seqs):
            n = starts[i + 1] - starts[i]
            if n == 1 or (n <= SHORT_QUERY and n < meta.seq_lens_cpu[i]):
                self._rows(query, k_cache, v_cache, meta, scale, i, out, window)
            elif n > 1:
                self._prefill(query, k_cache, v_cache, meta, scale, i, out, window)
        return out

    def _rows(self, query, k_cache, v_cache, meta, scale, i: int, out: torch.Tensor,
              window: int | None = None) -> None:
        """Sequence ``i``'s new rows, each against exactly the keys it sees (see the module
        docstring): one unmasked SDPA per row, its query heads ``[1, Hkv, G, D]`` side by side
        as the rows of their kv group, so no K/V repeat is needed."""
        block_size, kv_heads, dim = k_cache.shape[1:]
        group = query.shape[1] // kv_heads
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        first = seq_len - (end - start) + 1  # keys seen by the first new row
        # Blocks from the one holding the first key any row sees (all of them without a window).
        lo_block = 0 if window is None else max(0, first - window) // block_size
        blocks = meta.block_tables[i, lo_block:-(-seq_len // block_size)].long()
        base = lo_block * block_size  # position of the gathered keys' first row
        # [1, S, Hkv, D] -> [1, Hkv, S, D]
        k = _gather_blocks(k_cache, blocks).view(1, -1, kv_heads, dim).transpose(1, 2).float()
        v = _gather_blocks(v_cache, blocks).view(1, -1, kv_heads, dim).transpose(1, 2).float()
        for j, t in enumerate(range(start, end)):
            q = query[t].reshape(1, kv_heads, group, dim).float()
            n = first + j
            lo = 0 if window is None else max(0, n - window)
            o = F.scaled_dot_product_attention(q, k[:, :, lo - base:n - base], v[:, :, lo - base:n - base],
                                               scale=scale)
            out[t] = o.reshape(-1, dim).to(out.dtype)

    def _prefill(self, query, k_cache, v_cache, meta, scale, i: int, out: torch.Tensor,
                 window: int | None = None) -> None:
        """Sequence ``i`` with several query tokens: the last ``q_len`` of ``seq_len`` positions."""
        block_size, kv_heads, dim = k_cache.shape[1:]
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        q_len, seq_len = end - start, meta.seq_lens_cpu[i]
        num_blocks = -(-seq_len // block_size)
        # With a window, keys before the first row's window are never read: gather from the
        # block holding its first visible key.
        lo_block = 0 if window is None else max(0, seq_len - q_len + 1 - window) // block_size
        base = lo_block * block_size
        blocks = meta.block_tables[i, lo_block:num_blocks].long()
        # [S, Hkv, D] -> [Hkv, S, D]
        k = _gather_blocks(k_cache, blocks).view(-1, kv_heads, dim)[:seq_len - base]
        v = _gather_blocks(v_cache, blocks).view(-1, kv_heads, dim)[:seq_len - base]
        k, v = k.transpose(0, 1).float(), v.transpose(0, 1).float()
        # Every call below is 4-D: torch's fused CPU kernel (flash attention) takes only 4-D
        # inputs with GQA or an additive mask; 3-D ones, GQA expansion by repeat or a boolean
        # mask go through the unfused path (300 of 300 causal: 2.6 vs 6.7 ms; 5 of 300 behind
        # a cached prefix: 0.07 vs 0.86 ms).
        k, v = k[None], v[None]
        if q_len == seq_len and (window is None or seq_len <= window):
            q = query[start:end].transpose(0, 1)[None].float()  # [1, H, q_len, D]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1).to(out.dtype)
            return
        # Behind a cached prefix (a later prefill chunk, forced tokens, drafts): the query
        # heads of one kv group go side by side as extra rows, [1, Hkv, G * q_len, D], under
        # an additive mask (the layout the decode path uses for its single row).
        group = query.shape[1] // kv_heads
        q = query[start:end].reshape(q_len, kv_heads, group, dim).permute(1, 2, 0, 3)
        q = q.reshape(1, kv_heads, group * q_len, dim).float()
        # Row j sits at position seq_len - q_len + j and sees keys 0..that position (the last
        # ``window`` of them with a window); gathered key i sits at position base + i.
        rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
        keys = torch.arange(base, seq_len, device=q.device)[None, :]
        hidden = keys > rows
        if window is not None:
            hidden |= keys <= rows - window
        mask = torch.zeros(hidden.shape, device=q.device).masked_fill_(hidden, float("-inf"))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(group, 1)[None, None],
                                           scale=scale)
        o = o.view(kv_heads, group, q_len, dim).permute(2, 0, 1, 3).reshape(q_len, -1, dim)
        out[start:end] = o.to(out.dtype)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Rows ``blocks`` (int64 ``[N]``) of ``cache`` viewed as ``[num_blocks, block_size * H * D]``.

    ``index_select`` on the 2-D view copies whole blocks; measured on CPU it is many times
    faster than advanced indexing of the 4-D cache with a 2-D index.
    """
    return cache.view(cache.shape[0], -1).index_select(0, blocks)
