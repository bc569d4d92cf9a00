"""Per-request block tables on top of the block pools, with prefix caching.

KV cache groups (vLLM's hybrid KV cache allocator; llama.cpp's SWA cache). A model whose layers
all attend to every earlier position keeps one group: one block pool, one block table per
request (``Request.block_ids``), every position of every layer. A model that mixes full-attention
layers with sliding-window ones (Gemma 3: five local layers of window 512 to one global) keeps
two: group 0 the full-attention layers, group 1 the windowed ones, each with its own pool, its
own per-request table (``Request.window_block_ids``) and its own per-layer cache tensors
(``stencil.engine.model_runner``). A request's window-group block ``i`` is released as soon as no later
query of the request can see any of its tokens: queries only move forward, and a key at
position ``k`` is visible from a query at ``p`` when ``k > p - W`` (``stencil.kernels.attention_backend``),
so once the request has computed ``c`` tokens, blocks wholly before position ``c - W + 1`` are
dead. Their table entries then point at the pool's null block (``stencil.engine.block_pool.NULL_BLOCK``),
which every attention backend skips (the C kernels and the torch reference read from each row's
first visible key) or reads as zeros under its window mask (``stencil.kernels.flash.gather_kv``). A model
whose layers all have a window keeps one group with a window.

Prefix caching stays exact across groups: both tables are keyed by the same chained block
hashes, a window-group block released mid-request keeps its hash in its pool's free queue, and a
hit of length ``L`` needs group 0's blocks for ``[0, L)`` and the window group's blocks covering
the window before ``L`` (vLLM's ``SlidingWindowManager``); the hit is the longest prefix every
group can serve (``get_computed_blocks``).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from stencil.engine.block_pool import NULL_BLOCK, BlockPool
from stencil.engine.request import Request


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: tuple | None = None) -> int:
    """Chained digest of a full block: its parent's hash, its token ids, and ``extra``.

    ``extra`` stands for anything else that changes the block's K/V (here: how many of its
    tokens were prompt tokens, when prompt and output tokens run through different weights),
    so equal hashes imply equal K/V. It must be ``None`` or a tuple of str / int.

    The digest is BLAKE2b (8 bytes, as an unsigned int) over canonical bytes — the parent hash
    as 8 little-endian bytes (or a marker for the first block), each token id as 4 little-endian
    bytes, then ``repr(extra)`` — so every process computes the same chain: replicas and the
    router that sends a request to the replica caching its prefix (``stencil.service.cluster``). Python's
    ``hash`` is salted per process (``PYTHONHASHSEED``) and could not be shared. A hit is still
    confirmed against the stored token ids (``BlockPool.lookup``), so a collision is never a hit.

    Raises:
        struct.error: a token id outside ``[0, 2**32)``.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(_NO_PARENT if parent_hash is None else parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra is not None:
        h.update(repr(extra).encode())
    return int.from_bytes(h.digest(), "little")


_NO_PARENT = b"stencil\x00\x00"  # 9 bytes: never equal to an 8-byte parent hash


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of a prompt, as ``KVCacheManager`` computes them.

    Blocks that hold prompt tokens only carry no ``extra``, so this chain equals the engine's
    for any request with this prompt; a router can compute it without an engine.

    Args:
        token_ids: prompt token ids.
        block_size: tokens per block (the engines' ``block_size``).
        max_blocks: hash at most this many leading blocks (``None``: every full block).

    Returns:
        ``len(token_ids) // block_size`` hashes (or ``max_blocks``, if fewer), first block first.
    """
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    parent = None
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table per request and one block pool.

    Attributes:
        num_blocks: blocks the group's requests can hold together (a group with a window has one
            more in its pool and tensors: the null block).
        window: the layers' sliding window in tokens (the largest, if they differ), or None for
            full attention. A group with a window keeps only the blocks a later query can see.
    """

    num_blocks: int
    window: int | None = None

    @property
    def pool_blocks(self) -> int:
        """Blocks of the group's pool and of each of its layers' cache tensors."""
        return self.num_blocks + (self.window is not None)


def window_pool_need(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a window group's running requests can hold at once (``kv_cache_groups``)."""
    return (max_num_seqs * (math.ceil((window - 1) / block_size) + 2)
            + math.ceil(max_num_batched_tokens / block_size))


def blocks_for_bytes(budget: int, layer_block_bytes: int, layer_windows: Sequence[int | None], *, block_size: int,
                     max_num_seqs: int, max_num_batched_tokens: int, hybrid: bool = True) -> int:
    """The full group's block count (``num_kv_blocks``) whose cache tensors, every group's, fit
    ``budget`` bytes (``--kv-cache-gib``, or the default share of free memory).

    ``layer_block_bytes``: one block of one layer, K and V. Without a window group every layer
    holds every block: ``budget // (layers * layer_block_bytes)``. With one (``kv_cache_groups``),
    the windowed layers hold ``min(N, need) + 1`` blocks (the null block) while the full-attention
    layers hold ``N``, so the same bytes buy more tokens: Gemma 3 270M (3 global, 15 local layers)
    holds up to six times as many once ``N`` passes the window pool's ``need``. At least 1.
    """
    windows = list(layer_windows)
    groups, layer_groups = kv_cache_groups(windows, 1, block_size=block_size, max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=max_num_batched_tokens, hybrid=hybrid)
    if len(groups) == 1:
        return max(budget // (len(windows) * layer_block_bytes), 1)
    full = layer_groups.count(0)
    windowed = len(windows) - full
    need = window_pool_need(groups[1].window, block_size, max_num_seqs, max_num_batched_tokens)
    # window pool at its cap (N >= need): full N + windowed (need + 1) blocks of each layer
    n = (budget // layer_block_bytes - windowed * (need + 1)) // full
    if n < need:  # the window pool as large as the full one: (N + 1) windowed, N full
        n = (budget // layer_block_bytes - windowed) // (full + windowed)
    return max(n, 1)


def kv_cache_groups(layer_windows: Sequence[int | None], num_blocks: int, *, block_size: int,
                    max_num_seqs: int, max_num_batched_tokens: int,
                    hybrid: bool = True) -> tuple[list[KVCacheGroup], list[int]]:
    """Split a model's layers into KV cache groups (see the module docstring).

    * no layer with a window, or ``hybrid`` off: one full-attention group of ``num_blocks``
      blocks, every position of every layer kept (the layout before groups; Llama, SmolLM2);
    * every layer with a window (Mistral): one group of ``num_blocks`` blocks with that window;
    * both kinds (Gemma 3): group 0 the full-attention layers with ``num_blocks`` blocks, so
      ``num_kv_blocks`` still names the token capacity (a byte budget buys more of it:
      ``blocks_for_bytes``); group 1 the windowed
      layers with ``min(num_blocks, max_num_seqs * (ceil((W - 1) / block_size) + 2) +
      ceil(max_num_batched_tokens / block_size))`` blocks: what the running requests hold at
      once. A request whose step computes ``n`` tokens from position ``p`` holds the window
      group's blocks of positions ``p - W + 1 .. p + n - 1``, at most ``ceil((W - 1) /
      block_size) + 1 + ceil(n / block_size)`` of them, and a step's ``n`` add up to at most
      ``max_num_batched_tokens``. More than ``num_blocks`` is never needed: a request's
      window-group entries are a subset of its group-0 ones, so a window pool as large as
      group 0's never runs out first. Where it runs out anyway (a request between steps keeps
      the blocks of drafts it rejected), the scheduler preempts, as it does for group 0.

    Returns:
        (groups, the group index of each layer).
    """
    windows = list(layer_windows)
    sliding = [w for w in windows if w is not None]
    if not hybrid or not sliding:
        return [KVCacheGroup(num_blocks)], [0] * len(windows)
    window = max(sliding)
    if len(sliding) == len(windows):
        return [KVCacheGroup(num_blocks, window)], [0] * len(windows)
    need = window_pool_need(window, block_size, max_num_seqs, max_num_batched_tokens)
    groups = [KVCacheGroup(num_blocks), KVCacheGroup(min(num_blocks, need), window)]
    return groups, [0 if w is None else 1 for w in windows]


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request, in every KV cache group.

    "Out of blocks" is a return value (``allocate_slots`` → False, when any group's pool is
    short) that the scheduler answers by preempting a request; this class never preempts on its
    own. ``num_blocks``, ``num_free_blocks`` and ``usage`` speak of group 0 (the token
    capacity); ``group_blocks`` reports every group.

    Args:
        num_blocks: blocks of group 0.
        block_size: tokens per block.
        enable_prefix_caching: reuse cached full blocks across requests.
        hash_prompt_boundary: the model computes prompt and output tokens differently
            (``ModelRunner.prompt_rows_routed``), so a block that holds output tokens may only be
            reused by a request whose prompt ends at the same place in it.
        groups: the KV cache groups (``kv_cache_groups``), group 0 of ``num_blocks`` blocks; None:
            one full-attention group.

    Raises:
        ValueError: ``groups`` empty, more than two, or group 0 not of ``num_blocks`` blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_prompt_boundary: bool = False, *, groups: Sequence[KVCacheGroup] | None = None):
        self.groups = list(groups) if groups is not None else [KVCacheGroup(num_blocks)]
        if not 1 <= len(self.groups) <= 2 or self.groups[0].num_blocks != num_blocks:
            raise ValueError(f"expected one or two KV cache groups, the first of {num_blocks} blocks; "
                             f"got {self.groups}")
        self.block_size = block_size
        self.hash_prompt_boundary = hash_prompt_boundary
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(g.pool_blocks, enable_caching=enable_prefix_caching, null_block=g.window is not None)
                      for g in self.groups]
        self.pool = self.pools[0]
        self._hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def set_prefix_caching(self, enabled: bool) -> None:
        """Switch prefix caching on or off (benchmarks); the cached hashes are dropped either way."""
        self.enable_prefix_caching = enabled
        for pool in self.pools:
            pool.enable_caching = enabled
            pool.reset_prefix_cache()

    @property
    def num_blocks(self) -> int:
        return self.pool.capacity

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.capacity

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def group_blocks(self) -> list[tuple[int, int]]:
        """``(blocks, free blocks)`` of each group's pool, group 0 first (the null block not counted)."""
        return [(pool.capacity, pool.num_free_blocks) for pool in self.pools]

    def block_tables(self, request: Request) -> list[list[int]]:
        """The request's block table in each group (the lists themselves), group 0 first."""
        return [request.block_ids, request.window_block_ids][:len(self.groups)]

    def first_live_block(self, position: int, group: int) -> int:
        """Index of the first block a query at ``position`` can see in ``group`` (0 without a window)."""
        window = self.groups[group].window
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            tokens = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
            extra = None
            if self.hash_prompt_boundary and request.num_prompt_tokens < (i + 1) * bs:
                extra = ("prompt_tokens", max(request.num_prompt_tokens - i * bs, 0))
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens, extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Longest prefix of the request's tokens whose K/V every group holds in its cache.

        Group 0 (full attention) needs every block of the prefix; a group with a window needs
        only the blocks the prefix's next query can see, so the hit is the longest ``L`` for
        which group 0 holds blocks ``[0, L)`` and the window group the blocks from
        ``first_live_block(L)`` to ``L`` (its entries before those are ``NULL_BLOCK``). At least
        one token is always left to compute (the step needs its logits), so a prefix that
        covers every token is cut back by one block.

        Returns:
            (per group, the block ids in position order; the number of tokens they cover).
            Blocks are not yet referenced: pass them to ``allocate_slots`` as ``cached_blocks``.
        """
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._block_hashes(request, max_blocks)
        tokens: dict[int, tuple[int, ...]] = {}  # block i's token ids, made when first looked up
        n = max_blocks
        found: list[list[int | None]] = []
        for g, pool in enumerate(self.pools):
            ids: list[int | None] = []
            run = 0  # cached blocks in a row ending at block i
            best = 0
            for i in range(n):
                if i not in tokens:
                    tokens[i] = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
                block_id = pool.lookup(hashes[i], tokens[i])
                if block_id is None and self.groups[g].window is None:
                    break  # a full-attention group needs every block
                ids.append(block_id)
                run = run + 1 if block_id is not None else 0
                if run >= i + 1 - self.first_live_block((i + 1) * bs, g):
                    best = i + 1
            found.append(ids)
            n = best
        # A window group's answer can only shorten the hit; a full group's run is a prefix, so
        # it still serves the shorter one (and kv_cache_groups puts the full group first).
        hit = [[NULL_BLOCK if i < self.first_live_block(n * bs, g) else ids[i] for i in range(n)]
               for g, ids in enumerate(found)]
        return hit, n * bs

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup for the hit rate."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[list[int]] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        First releases the window-group blocks no query from ``num_computed_tokens`` on can see.
        ``cached_blocks`` (per group, from ``get_computed_blocks``, first admission only) are
        referenced and placed at the head of the block tables. Returns False, taking no block,
        when any group's pool has too few free blocks.
        """
        self.release_out_of_window(request)
        bs = self.block_size
        want = -(-(request.num_computed_tokens + num_new_tokens) // bs)
        tables = self.block_tables(request)
        cached = cached_blocks if cached_blocks and cached_blocks[0] else [[] for _ in self.groups]
        needs = []
        for pool, table, blocks in zip(self.pools, tables, cached):
            needed = want - len(table) - len(blocks)
            # Cached blocks with ref 0 leave the free queue when touched: count them as used.
            idle_cached = sum(1 for b in blocks if pool.blocks[b].ref_count == 0 and not _null(pool, b))
            if needed > pool.num_free_blocks - idle_cached:
                return False
            needs.append(needed)
        for g, (pool, table, blocks, needed) in enumerate(zip(self.pools, tables, cached, needs)):
            if blocks:
                pool.touch([b for b in blocks if not _null(pool, b)])
                table.extend(blocks)
                if g == 0:
                    # The hit's blocks are registered already; the ones allocated below are not
                    # (cache_full_blocks registers them once computed).
                    request.num_cached_blocks = len(table)
            if needed > 0:
                new = pool.allocate(needed)
                assert new is not None  # checked above
                table.extend(new)
        return True

    def release_out_of_window(self, request: Request) -> None:
        """Give back the window-group blocks no later query of the request can see: those wholly
        before position ``num_computed_tokens - W + 1``. Their entries become ``NULL_BLOCK``; a
        block keeps its hash in the free queue, so it still serves prefix-cache hits until
        evicted. Nothing to do without a window group."""
        for g, (pool, table) in enumerate(zip(self.pools, self.block_tables(request))):
            if self.groups[g].window is None:
                continue
            i = min(self.first_live_block(request.num_computed_tokens, g), len(table)) - 1
            # Entries are released in position order, so the first null one going down ends the run.
            while i >= 0 and table[i] != NULL_BLOCK:
                pool.free([table[i]])
                table[i] = NULL_BLOCK
                i -= 1

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose K/V are computed for accepted tokens, in every
        group, then release the window-group blocks that fell out of its window
        (``release_out_of_window``).

        Only tokens in ``all_token_ids`` count (never draft positions whose K/V may belong to
        rejected drafts), so a hash never covers rejected K/V.
        """
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        if self.enable_prefix_caching and num_full > request.num_cached_blocks:
            hashes = self._block_hashes(request, num_full)
            for pool, table in zip(self.pools, self.block_tables(request)):
                for i in range(request.num_cached_blocks, num_full):
                    if not _null(pool, table[i]):
                        pool.register(table[i], hashes[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
            request.num_cached_blocks = num_full
        self.release_out_of_window(request)

    def cached_block_hashes(self, limit: int | None = None) -> list[int]:
        """Hashes of the blocks group 0's prefix cache holds now (idle ones included), for routers
        (a hit also needs a window group's blocks, which may have been evicted: then it is shorter).

        Safe to call from another thread than the engine's: ``list(dict)`` copies the keys in
        one C call under the GIL; a concurrent resize is retried. ``limit`` keeps the first
        ``limit`` (oldest registered) hashes.
        """
        for _ in range(3):
            try:
                keys = list(self.pool.cached)
                break
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        else:
            return []
        return keys if limit is None else keys[:limit]

    def free(self, request: Request) -> None:
        """Release every block of the request in every group (tail first, so shared heads stay
        cached longest)."""
        for pool, table in zip(self.pools, self.block_tables(request)):
            pool.free([b for b in reversed(table) if not _null(pool, b)])
            table.clear()
        request.num_cached_blocks = 0
        self._hashes.pop(request.request_id, None)

    def check_invariants(self, requests: Sequence[Request]) -> None:
        """Raise AssertionError if a pool is inconsistent with the tables of ``requests`` (every
        request holding blocks): each pool's reference counts equal its tables' holders, every
        group's table has group 0's length, and a window group's entries are the null block
        exactly before the first block a later query can see (released at once, never early)."""
        tables = [self.block_tables(r) for r in requests]
        for g, pool in enumerate(self.pools):
            owners: dict[int, int] = {}
            for t in tables:
                for b in t[g]:
                    if not _null(pool, b):
                        owners[b] = owners.get(b, 0) + 1
            pool.check_invariants(owners)
        for r, t in zip(requests, tables):
            for g, table in enumerate(t):
                assert len(table) == len(t[0]), f"{r}: group {g} has {len(table)} entries, group 0 {len(t[0])}"
                live = self.first_live_block(r.num_computed_tokens, g)
                nulls = [_null(self.pools[g], b) for b in table]
                assert nulls == [i < live for i in range(len(table))], (
                    f"{r}: group {g} must point at the null block before block {live} only: {table}")


def _null(pool: BlockPool, block_id: int) -> bool:
    """Whether ``block_id`` is ``pool``'s null block (a window group's entry out of every window)."""
    return pool.null_block and block_id == NULL_BLOCK
