"""Per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from engine.block_pool import BlockPool
from engine.request import Request


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: tuple | None = None) -> int:
    """Chained digest of a full block: its parent's hash, its token ids, and ``extra``.

    ``extra`` stands for anything else that changes the block's K/V (here: how many of its
    tokens were prompt tokens, when prompt and output tokens run through different weights),
    so equal hashes imply equal K/V. It must be ``None`` or a tuple of str / int.

    The digest is BLAKE2b (8 bytes, as an unsigned int) over canonical bytes — the parent hash
    as 8 little-endian bytes (or a marker for the first block), each token id as 4 little-endian
    bytes, then ``repr(extra)`` — so every process computes the same chain: replicas and the
    router that sends a request to the replica caching its prefix (``service.cluster``). Python's
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


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request.

    "Out of blocks" is a return value (``allocate_slots`` → False) that the scheduler answers
    by preempting a request; this class never preempts on its own.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_prompt_boundary: bool = False):
        """``hash_prompt_boundary``: the model computes prompt and output tokens differently
        (``ModelRunner.prompt_rows_routed``), so a block that holds output tokens may only be
        reused by a request whose prompt ends at the same place in it."""
        self.block_size = block_size
        self.hash_prompt_boundary = hash_prompt_boundary
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def set_prefix_caching(self, enabled: bool) -> None:
        """Switch prefix caching on or off (benchmarks); the cached hashes are dropped either way."""
        self.enable_prefix_caching = enabled
        self.pool.enable_caching = enabled
        self.pool.reset_prefix_cache()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

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

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute (the step needs its logits), so a prefix
        that covers every token is cut back by one block.

        Returns:
            (block ids, number of tokens they cover). Blocks are not yet referenced: pass them
            to ``allocate_slots`` as ``cached_blocks``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._block_hashes(request, max_blocks)
        hit: list[int] = []
        for i in range(max_blocks):
            tokens = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
            block_id = self.pool.lookup(hashes[i], tokens)
            if block_id is None:
                break
            hit.append(block_id)
        return hit, len(hit) * bs

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup for the hit rate."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        ``cached_blocks`` (from ``get_computed_blocks``, first admission only) are referenced and
        placed at the head of the block table. Returns False, changing nothing, when the pool
        has too few free blocks.
        """
        cached_blocks = cached_blocks or []
        bs = self.block_size
        total = request.num_computed_tokens + num_new_tokens
        needed = -(-total // bs) - len(request.block_ids) - len(cached_blocks)
        # Cached blocks with ref 0 leave the free queue when touched: count them as used.
        idle_cached = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        if needed > self.pool.num_free_blocks - idle_cached:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.block_ids.extend(cached_blocks)
            request.num_cached_blocks = len(request.block_ids)
        if needed > 0:
            new = self.pool.allocate(needed)
            assert new is not None  # checked above
            request.block_ids.extend(new)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose K/V are computed for accepted tokens.

        Only tokens in ``all_token_ids`` count (never draft positions whose K/V may belong to
        rejected drafts), so a hash never covers rejected K/V.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            tokens = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
            self.pool.register(request.block_ids[i], hashes[i], tokens)
        request.num_cached_blocks = num_full

    def cached_block_hashes(self, limit: int | None = None) -> list[int]:
        """Hashes of the blocks the prefix cache holds now (idle ones included), for routers.

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
        """Release every block of the request (tail first, so shared heads stay cached longest)."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_cached_blocks = 0
        self._hashes.pop(request.request_id, None)
