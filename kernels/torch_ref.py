"""Reference paged attention in plain torch (CPU and any other device torch runs on).

Semantics are those of ``kernels.base`` (flat batch, paged K/V, causal over the cached prefix
plus the new tokens). Two paths:

* sequences with one query token (decode) are batched: their K/V are gathered into a padded
  ``[B, max_len, num_kv_heads, head_dim]`` tensor and masked by length, so a decode step costs
  one SDPA call per layer rather than one per sequence;
* sequences with a few query tokens behind a cached prefix (forced tokens, speculative
  drafts: up to ``SHORT_QUERY``) are batched the same way, padded to the longest;
* other sequences with several query tokens (prefill, a prefill chunk after a cached prefix)
  run one ``scaled_dot_product_attention`` each, with ``is_causal`` when nothing is cached and
  an additive offset-causal mask otherwise.

Attention is computed in fp32 whatever the cache dtype, so this backend is the accuracy
oracle for the faster ones.

Sources: scaled dot-product attention (Vaswani et al. 2017, arXiv 1706.03762); the paged
K/V layout and slot mapping of vLLM (Kwon et al. 2023, arXiv 2309.06180); grouped-query
attention (Ainslie et al. 2023, arXiv 2305.13245).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.base import AttentionMetadata


SHORT_QUERY = 16  # up to this many query tokens behind a cached prefix: batched (``_short``)


class TorchAttentionBackend:
    """Paged attention by gathering K/V through the block table, then torch SDPA.

    Args:
        device: accepted for the registry's uniform constructor; the backend works on
            whatever device its input tensors live on.
    """

    name = "torch"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._mask_key: tuple | None = None
        self._mask: torch.Tensor | None = None
        self._mask_ref: torch.Tensor | None = None
        self._short_key: tuple | None = None
        self._short_cached: tuple | None = None
        self._short_ref: torch.Tensor | None = None

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
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of every query row over its sequence's K/V (GQA: head ``h`` reads
        kv head ``h // (num_heads // num_kv_heads)``, as transformers' ``repeat_kv``).

        Returns:
            ``[T, num_heads, head_dim]`` in ``query.dtype``.
        """
        out = torch.empty_like(query)
        starts = meta.query_start_loc_cpu
        q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        if decode:
            self._decode(query, k_cache, v_cache, meta, scale, decode, out)
        short = [i for i, n in enumerate(q_lens) if 1 < n <= SHORT_QUERY
                 and n < meta.seq_lens_cpu[i]]
        if len(short) == 1 == meta.num_seqs:
            self._rows_as_decode(query, k_cache, v_cache, meta, scale, short[0], out)
        elif len(short) > 1:
            self._short(query, k_cache, v_cache, meta, scale, short, out)
        else:
            short = []
        for i, n in enumerate(q_lens):
            if n > 1 and i not in short:
                self._prefill(query, k_cache, v_cache, meta, scale, i, out)
        return out

    def _rows_as_decode(self, query, k_cache, v_cache, meta, scale, i: int, out: torch.Tensor) -> None:
        """A lone sequence's few new rows (forced tokens, drafts), each computed exactly as
        ``_decode`` computes a single row, so its output is bit for bit what decoding the
        tokens one by one gives.

        One masked call for all rows is cheaper (66 vs 4 x 37 us for 4 rows over 400 keys), but
        torch's CPU kernels round differently with the number of query rows and of keys (by
        ~1e-7), and int4's bf16 activations magnify such differences into flipped greedy tokens
        (4 of 16 extraction outputs of SmolLM2): speculation must not change a lone request's
        output. Several sequences already decode through one padded call (``_decode``), whose
        rounding depends on the batch; there the batched ``_short`` path is kept.
        """
        block_size, kv_heads, dim = k_cache.shape[1:]
        group = query.shape[1] // kv_heads
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        blocks = meta.block_tables[i, :-(-seq_len // block_size)].long()
        k = _gather_blocks(k_cache, blocks).view(1, -1, kv_heads, dim).transpose(1, 2).float()
        v = _gather_blocks(v_cache, blocks).view(1, -1, kv_heads, dim).transpose(1, 2).float()
        first = seq_len - (end - start) + 1  # keys seen by the first new row
        for j, t in enumerate(range(start, end)):
            q = query[t].reshape(1, kv_heads, group, dim).float()
            n = first + j
            o = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale)
            out[t] = o.reshape(-1, dim).to(out.dtype)

    def _short(self, query, k_cache, v_cache, meta, scale, seqs: list[int], out: torch.Tensor) -> None:
        """A few query tokens behind a cached prefix for each of ``seqs`` (forced tokens, drafts):
        one padded SDPA for all, ``[B, Hkv, G * Q, D]`` queries under an additive mask, instead
        of one call per sequence (the per-call overhead dominated steps where many requests
        take forced tokens)."""
        block_size, kv_heads, dim = k_cache.shape[1:]
        group = query.shape[1] // kv_heads
        rows, valid, mask, tables = self._short_layout(meta, seqs, group, block_size, query.device)
        b, q_max = rows.shape
        s_max = mask.shape[-1]
        k = _gather_blocks(k_cache, tables).view(b, -1, kv_heads, dim)[:, :s_max]
        v = _gather_blocks(v_cache, tables).view(b, -1, kv_heads, dim)[:, :s_max]
        k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()
        q = query[rows.flatten()].view(b, q_max, kv_heads, group, dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * q_max, dim).float()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.view(b, kv_heads, group, q_max, dim).permute(0, 3, 1, 2, 4).reshape(b, q_max, -1, dim)
        out[rows[valid]] = o[valid].to(out.dtype)

    def _short_layout(self, meta, seqs: list[int], group: int, block_size: int, device):
        """Query rows ``[B, Q]``, which are real ``[B, Q]``, the additive mask
        ``[B, 1, G * Q, S]`` and the flat block ids of ``_short``; the same for every layer of a
        step, so the last one is kept (keyed like ``_length_mask``)."""
        key = (id(meta.seq_lens), tuple(seqs), group)
        if self._short_key == key:
            return self._short_cached
        starts = meta.query_start_loc_cpu
        q_lens = torch.tensor([starts[i + 1] - starts[i] for i in seqs])
        lens = torch.tensor([meta.seq_lens_cpu[i] for i in seqs])
        b, q_max, s_max = len(seqs), int(q_lens.max()), int(lens.max())
        # Padded query slots repeat the sequence's last row; their outputs are dropped.
        j = torch.arange(q_max)
        last = torch.minimum(j[None, :], q_lens[:, None] - 1)
        rows = torch.tensor([starts[i] for i in seqs])[:, None] + last
        # Row j of sequence i sits at position len_i - q_len_i + j and sees keys up to it.
        pos = (lens - q_lens)[:, None] + last
        hidden = torch.arange(s_max)[None, None, :] > pos[:, :, None]  # [B, Q, S]
        mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
        mask = mask[:, None].expand(b, group, q_max, s_max).reshape(b, 1, group * q_max, s_max)
        idx = torch.tensor(seqs, device=meta.block_tables.device)
        tables = meta.block_tables[idx, :-(-s_max // block_size)].long().flatten()
        self._short_cached = (rows.to(device), (j[None, :] < q_lens[:, None]).to(device),
                              mask.to(device), tables)
        self._short_key = key
        self._short_ref = meta.seq_lens  # keeps the id from being reused while cached
        return self._short_cached

    def _decode(self, query, k_cache, v_cache, meta, scale, seqs: list[int],
                out: torch.Tensor) -> None:
        """One query token per sequence for ``seqs``: a single padded, length-masked SDPA."""
        block_size, kv_heads, dim = k_cache.shape[1:]
        heads = query.shape[1]
        group = heads // kv_heads
        lens = [meta.seq_lens_cpu[i] for i in seqs]
        max_len = max(lens)
        num_blocks = -(-max_len // block_size)
        all_seqs = len(seqs) == meta.num_seqs
        if all_seqs:
            rows = None
            tables = meta.block_tables[:, :num_blocks]
            seq_lens = meta.seq_lens
        else:
            idx = torch.tensor(seqs, device=query.device)
            rows = meta.query_start_loc[idx].long()
            tables = meta.block_tables[idx, :num_blocks]
            seq_lens = meta.seq_lens[idx]
        b = len(seqs)
        tables = tables.long()
        # [B * blocks, block_size * Hkv * D] -> [B, Hkv, S, D]
        k = _gather_blocks(k_cache, tables.flatten()).view(b, -1, kv_heads, dim)
        v = _gather_blocks(v_cache, tables.flatten()).view(b, -1, kv_heads, dim)
        k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()
        # All query heads of one kv group share the single position, so the group can stand in
        # for the query length: [B, Hkv, G, D] against [B, Hkv, S, D] needs no K/V repeat.
        q = (query if all_seqs else query[rows]).reshape(b, kv_heads, group, dim).float()
        if b == 1:
            # One sequence: cut K/V to its length and skip the mask (SDPA's masked path costs
            # more than the attention itself at this size).
            n = lens[0]
            o = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self._length_mask(seq_lens, k.shape[2]),
                                               scale=scale)
        o = o.reshape(b, heads, dim).to(out.dtype)
        if all_seqs:
            # Every sequence has one query row, so rows are 0..B-1 in order.
            out.copy_(o)
        else:
            out[rows] = o

    def _length_mask(self, seq_lens: torch.Tensor, width: int) -> torch.Tensor:
        """Additive mask ``[B, 1, 1, width]``: 0 inside each sequence, -inf past its end.

        Every layer of a step asks for the same mask, so the last one is kept (keyed by the
        lengths tensor, which the runner builds once per step).
        """
        key = (id(seq_lens), width)
        if self._mask_key != key:
            pos = torch.arange(width, device=seq_lens.device)
            inside = pos[None, :] < seq_lens[:, None].to(pos.dtype)
            mask = torch.zeros(inside.shape, dtype=torch.float32, device=seq_lens.device)
            self._mask = mask.masked_fill_(~inside, float("-inf"))[:, None, None, :]
            self._mask_key = key
            self._mask_ref = seq_lens  # keeps the id from being reused while cached
        return self._mask

    def _prefill(self, query, k_cache, v_cache, meta, scale, i: int, out: torch.Tensor) -> None:
        """Sequence ``i`` with several query tokens: the last ``q_len`` of ``seq_len`` positions."""
        block_size, kv_heads, dim = k_cache.shape[1:]
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        q_len, seq_len = end - start, meta.seq_lens_cpu[i]
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[i, :num_blocks].long()
        # [S, Hkv, D] -> [Hkv, S, D]
        k = _gather_blocks(k_cache, blocks).view(-1, kv_heads, dim)[:seq_len]
        v = _gather_blocks(v_cache, blocks).view(-1, kv_heads, dim)[:seq_len]
        k, v = k.transpose(0, 1).float(), v.transpose(0, 1).float()
        # Every call below is 4-D: torch's fused CPU kernel (flash attention) takes only 4-D
        # inputs with GQA or an additive mask; 3-D ones, GQA expansion by repeat or a boolean
        # mask go through the unfused path (300 of 300 causal: 2.6 vs 6.7 ms; 5 of 300 behind
        # a cached prefix: 0.07 vs 0.86 ms).
        k, v = k[None], v[None]
        if q_len == seq_len:
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
        # Row j sits at position seq_len - q_len + j and sees keys 0..that position.
        rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
        hidden = torch.arange(seq_len, device=q.device)[None, :] > rows
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
