"""The attention backend interface shared by every kernel implementation.

A step's tokens form one flat batch with no padding: sequence ``i`` owns the query rows
``query_start_loc[i]:query_start_loc[i+1]``. Those rows are the *last* ``q_len_i`` tokens of
a sequence whose total length after this step is ``seq_lens[i]`` (cached prefix + new
tokens), so query row ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j``
and attends causally to positions ``0..that position``. K/V for all positions, the new
ones included, are read from the paged cache through ``block_tables`` after
``reshape_and_cache`` has written the new tokens into their slots.

A sliding-window layer (Mistral, Gemma 3's local layers) passes ``window=W``: the row at
position ``p`` then sees only keys ``max(0, p - W + 1)..p``, the last ``W`` positions itself
included (transformers' ``sliding_window_overlay``: key ``k`` visible when ``k > p - W``;
llama.cpp's standard SWA masks ``p - k >= W``, the same set). A backend that cannot mask a
window raises instead of attending to the whole prefix.

A cache may keep its windowed layers apart, in blocks of their own (``stencil.engine.kv_cache_manager``:
a hybrid cache's sliding-window group); they then read ``window_block_tables`` and
``window_slot_mapping`` (``AttentionMetadata.for_window``). There the entries of blocks that fell
out of the window point at a null block 0 whose K/V stay zero: a backend must never let them
reach an output, which it does by reading each row from its first visible key on (the C kernels,
the torch reference) or by masking them (flash-attn over ``stencil.kernels.flash.gather_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

BLOCK_SIZE = 16
"""Tokens per KV-cache block (vLLM's default). Upstream flash-attn's paged kernels want a larger
page size; ``kernels/flash`` documents how it copes."""


@dataclass(slots=True)
class AttentionMetadata:
    """Where every query token of a flat batch sits, and where its K/V live.

    Attributes:
        query_start_loc: int32 ``[B + 1]``; cumulative query lengths (``0`` first).
        seq_lens: int32 ``[B]``; per sequence, cached + new tokens after this step.
        block_tables: int32 ``[B, max_blocks_per_seq]``; block ids, padded with 0 past a
            sequence's last block (padding is never read: ``seq_lens`` bounds every read).
        slot_mapping: int64 ``[T]``; cache slot (``block_id * block_size + offset``) of each
            new token, where ``T = query_start_loc[-1]``.
        max_query_len: longest query of the batch (tokens).
        max_seq_len: longest ``seq_lens`` entry (tokens).
        query_start_loc_cpu: host copy of ``query_start_loc`` (avoids device syncs).
        seq_lens_cpu: host copy of ``seq_lens``.
        window_block_tables: int32 ``[B, max_blocks_per_seq]``, the block tables of the layers
            with a window when the cache keeps them in a group of their own (entries out of
            every window: the null block 0); None when those layers read ``block_tables``.
        window_slot_mapping: int64 ``[T]``, the new tokens' slots in that group; None likewise.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    window_block_tables: torch.Tensor | None = None
    window_slot_mapping: torch.Tensor | None = None

    def for_window(self) -> "AttentionMetadata":
        """The metadata a layer with a sliding window reads: its group's block tables and
        slots when the cache keeps windowed layers apart, else ``self``."""
        if self.window_block_tables is None:
            return self
        return replace(self, block_tables=self.window_block_tables, slot_mapping=self.window_slot_mapping,
                       window_block_tables=None, window_slot_mapping=None)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


class AttentionBackend(Protocol):
    """A paged attention implementation (registered by name in ``stencil.kernels.registry``)."""

    name: str

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        """Write each new token's K and V into its slot of the paged cache (in place)."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of every query token over its sequence's cached K/V (GQA aware);
        with ``window``, over its last ``window`` positions only (see the module docstring)."""
        ...
