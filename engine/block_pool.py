"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the prefix-cache index.

A block with reference count 0 sits in the free queue; if it is full and was hashed it keeps
its hash there, so a later request with the same prefix can take it back (a prefix-cache hit)
until allocation evicts it. Eviction takes the least recently freed block first.

Hashing (vLLM's prefix caching, Kwon et al. 2023, "PagedAttention", and the v1 design): block
``i`` of a sequence is keyed by a digest of (the key of block i-1, its 16 token ids, extra), so
equal keys mean equal prefixes (``stencil.engine.kv_cache_manager.hash_block``: BLAKE2b, the same in
every process). A 64-bit key can still collide, so a hit is confirmed against the token ids
stored with the block (as nano-vllm does).

A pool with a null block (``null_block=True``: a sliding-window group's pool,
``stencil.engine.kv_cache_manager``) keeps block 0 out of circulation: it is never allocated, never
written and never freed, and a block-table entry whose tokens fell out of every window points at
it. Its K/V stay the zeros the cache was made with, so a backend that reads such an entry under
its window mask (``stencil.kernels.flash.gather_kv``) reads finite values it then masks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens hashed, to confirm hits


NULL_BLOCK = 0
"""The block id a pool with ``null_block=True`` keeps out of circulation (see the module docstring)."""


class BlockPool:
    """Owns every block id in ``[0, num_blocks)`` (``NULL_BLOCK`` excepted with ``null_block``).

    Invariants (checked by ``check_invariants``): each block is either in the free queue with
    ref_count 0, or out of it with ref_count > 0; the hash index maps a hash to exactly one
    block that carries that hash; the null block is never free, held or hashed.

    Args:
        num_blocks: blocks in the pool, the null block included.
        enable_caching: keep freed full blocks' hashes for prefix-cache hits.
        null_block: reserve ``NULL_BLOCK``; ``capacity`` is then ``num_blocks - 1``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, null_block: bool = False):
        if num_blocks <= int(null_block):
            raise ValueError(f"num_blocks must be > {int(null_block)}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.null_block = null_block
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free queue, oldest first; OrderedDict gives O(1) removal of a block taken back on a hit.
        first = NULL_BLOCK + 1 if null_block else 0
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.hits = 0
        self.queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def capacity(self) -> int:
        """Blocks a request can hold: every block but the null block."""
        return self.num_blocks - int(self.null_block)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks from the head of the free queue (evicting their hashes).

        Returns None, taking nothing, when fewer than ``n`` are free.
        """
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            out.append(block_id)
        return out

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """Block id holding exactly these tokens under this hash, or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids:
            return None  # hash collision: not a hit
        return block_id

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (removing them from the free queue if idle)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Record a full block's hash so later requests can reuse it."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; keep that one as the canonical copy
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block_id

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue tail.

        Callers pass a request's blocks in reverse order so that its last blocks (the least
        likely to be shared) are evicted first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.cached.values()):
            self._evict(self.blocks[block_id])

    def check_invariants(self, owners: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool is inconsistent.

        Args:
            owners: optional block id -> number of requests holding it; when given, each
                block's ref_count must equal it.
        """
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue)
        for block in self.blocks:
            if self.null_block and block.block_id == NULL_BLOCK:
                assert block.ref_count == 0 and block.block_hash is None and block.block_id not in free, "null block"
                assert owners is None or NULL_BLOCK not in owners, "a request holds the null block"
                continue
            in_free = block.block_id in free
            assert in_free == (block.ref_count == 0), f"block {block.block_id}: ref {block.ref_count}, free {in_free}"
            if owners is not None:
                assert block.ref_count == owners.get(block.block_id, 0), (
                    f"block {block.block_id}: ref {block.ref_count} != owners {owners.get(block.block_id, 0)}")
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h
        assert len(free) + sum(1 for b in self.blocks if b.ref_count > 0) == self.capacity
