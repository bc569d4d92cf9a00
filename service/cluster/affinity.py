"""Prefix-affinity routing: send a request to the replica that already caches its prompt's prefix.

The policy alone, with no Ray in it (``stencil.service.cluster.routers`` adapts it to Ray Serve's
``RequestRouter``), so it is tested against fake replicas.

A request is known by the chained hashes of its prompt's full KV blocks
(``stencil.engine.kv_cache_manager.prompt_block_hashes``: stable digests, the same in every process).
Each replica reports the hashes of the blocks its prefix cache holds (``record_routing_stats``,
about once a second); the router adds an optimistic record of the prefixes it has just sent
where, since a report cannot show a prefix that is still being read. A replica's *match* is the
number of leading blocks of the request found, without a gap, in its reported or recorded
hashes: the engine's own lookup stops at the first miss too.

Ranking, as SGLang's cache-aware router and llm-d's prefix scorer do it in spirit:

1. The replica with the longest match wins (ties: the shorter queue, then a rendezvous hash of
   the first block), unless its queue is longer than the shortest queue by more than
   ``imbalance_threshold`` requests: then replicas are ranked least loaded first.
2. A miss (no match of ``min_match_blocks``) goes to the replica holding the fewest blocks (its
   reported cache and what was just routed there), so new prefixes spread over the caches
   instead of crowding one; ties go by queue length, then the rendezvous hash, so a prefix seen
   nowhere lands on the same replica from any router. If the queues are too uneven (as above),
   least loaded first instead.

Every replica appears in the ranking, one per rank, so Ray Serve falls through to the next one
when a replica is full (``max_ongoing_requests``).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field


@dataclass(slots=True)
class ReplicaView:
    """What the router knows of one replica when it ranks a request.

    Attributes:
        replica_id: the replica's id (Ray Serve's ``ReplicaID.unique_id``).
        cached: block hashes the replica reported as cached.
        queue_len: requests sent there and not finished (the larger of the router's own count
            and the replica's report).
        kv_usage: fraction of its KV blocks in use, in [0, 1].
    """

    replica_id: str
    cached: Set[int] = frozenset()
    queue_len: int = 0
    kv_usage: float = 0.0


@dataclass(slots=True)
class AffinityConfig:
    """Knobs of the policy.

    Attributes:
        imbalance_threshold: fall back to least-loaded when the best-matching replica's queue
            exceeds the shortest one by more than this many requests.
        min_match_blocks: a match shorter than this many blocks counts as a miss.
        optimistic_ttl_s: how long a prefix just routed to a replica counts as cached there
            before the replica's own report must confirm it (seconds; a few report periods plus
            the longest prefill).
        max_recorded_blocks: most optimistically recorded hashes per replica (oldest dropped).
    """

    imbalance_threshold: int = 4
    min_match_blocks: int = 1
    optimistic_ttl_s: float = 10.0
    max_recorded_blocks: int = 65_536

    def validate(self) -> "AffinityConfig":
        """Check ranges; return self.

        Raises:
            ValueError: naming the field.
        """
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold}")
        if self.min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be >= 1, got {self.min_match_blocks}")
        if self.optimistic_ttl_s < 0:
            raise ValueError(f"optimistic_ttl_s must be >= 0, got {self.optimistic_ttl_s}")
        if self.max_recorded_blocks < 0:
            raise ValueError(f"max_recorded_blocks must be >= 0, got {self.max_recorded_blocks}")
        return self


@dataclass(slots=True)
class RoutingDecision:
    """The ranking of one request.

    Attributes:
        ranks: replica ids, most preferred first, one per rank.
        reason: "match" (longest cached prefix), "miss" (no replica matches enough),
            "imbalance" (the best match is too busy) or "no_prefix" (no full prompt block).
        matched_blocks: leading blocks cached on the first-ranked replica.
    """

    ranks: list[list[str]]
    reason: str
    matched_blocks: int = 0


@dataclass(slots=True)
class _Recorded:
    """Hashes recently routed to one replica: hash -> time recorded (oldest first)."""

    at: OrderedDict[int, float] = field(default_factory=OrderedDict)


def rendezvous(key: int, replica_id: str) -> int:
    """Highest-random-weight score of ``replica_id`` for ``key`` (Thaler & Ravishankar 1998).

    Stable across processes (BLAKE2b), so every router places a new prefix on the same replica.
    """
    digest = hashlib.blake2b(key.to_bytes(8, "little") + replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class PrefixAffinityPolicy:
    """Ranks replicas for a request's block-hash chain (see the module docstring).

    Args:
        config: the knobs (validated here).
        clock: monotonic seconds; tests pass a fake one.
    """

    def __init__(self, config: AffinityConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = (config or AffinityConfig()).validate()
        self._clock = clock
        self._recorded: dict[str, _Recorded] = {}

    def match_blocks(self, chain: Sequence[int], replica: ReplicaView) -> int:
        """Leading blocks of ``chain`` cached on ``replica`` (reported, or recorded within the TTL)."""
        recorded = self._fresh(replica.replica_id)
        n = 0
        for h in chain:
            if h not in replica.cached and h not in recorded:
                break
            n += 1
        return n

    def footprint(self, replica: ReplicaView) -> int:
        """Blocks the replica holds as far as the router knows: reported, plus recorded within
        the TTL and not reported yet."""
        recorded = self._fresh(replica.replica_id)
        return len(replica.cached) + sum(1 for h in recorded if h not in replica.cached)

    def rank(self, chain: Sequence[int], replicas: Sequence[ReplicaView]) -> RoutingDecision:
        """Rank ``replicas`` for a request whose prompt has the block-hash chain ``chain``.

        Args:
            chain: the prompt's full-block hashes, first block first (may be empty).
            replicas: the candidates (any order; ids unique).

        Returns:
            A ``RoutingDecision``; ``ranks`` is empty when ``replicas`` is.
        """
        if not replicas:
            return RoutingDecision([], "miss")
        key = chain[0] if chain else 0
        by_load = sorted(replicas, key=lambda r: (r.queue_len, r.kv_usage, -rendezvous(key, r.replica_id)))
        if not chain:
            return RoutingDecision([[r.replica_id] for r in by_load], "no_prefix")
        matches = {r.replica_id: self.match_blocks(chain, r) for r in replicas}
        best = max(replicas, key=lambda r: (matches[r.replica_id], -r.queue_len, rendezvous(key, r.replica_id)))
        best_match = matches[best.replica_id]
        longest_queue = max(r.queue_len for r in replicas)
        if best_match < self.config.min_match_blocks:
            if longest_queue - by_load[0].queue_len > self.config.imbalance_threshold:
                return RoutingDecision([[r.replica_id] for r in by_load], "miss")
            held = {r.replica_id: self.footprint(r) for r in replicas}
            order = sorted(replicas, key=lambda r: (held[r.replica_id], r.queue_len, -rendezvous(key, r.replica_id)))
            return RoutingDecision([[r.replica_id] for r in order], "miss")
        if best.queue_len - by_load[0].queue_len > self.config.imbalance_threshold:
            # Among equally loaded replicas, one that holds the prefix still goes first.
            order = sorted(replicas, key=lambda r: (r.queue_len, -matches[r.replica_id], r.kv_usage,
                                                    -rendezvous(key, r.replica_id)))
            return RoutingDecision([[r.replica_id] for r in order], "imbalance", matches[order[0].replica_id])
        rest = sorted((r for r in replicas if r is not best),
                      key=lambda r: (-matches[r.replica_id], r.queue_len, -rendezvous(key, r.replica_id)))
        return RoutingDecision([[best.replica_id]] + [[r.replica_id] for r in rest], "match", best_match)

    def record_routed(self, replica_id: str, chain: Sequence[int]) -> None:
        """Remember that ``chain`` was just sent to ``replica_id`` (it will be cached there)."""
        if not chain or self.config.max_recorded_blocks == 0:
            return
        rec = self._recorded.setdefault(replica_id, _Recorded())
        now = self._clock()
        for h in chain:
            rec.at[h] = now
            rec.at.move_to_end(h)
        while len(rec.at) > self.config.max_recorded_blocks:
            rec.at.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """Drop what was recorded for a replica that died or left."""
        self._recorded.pop(replica_id, None)

    def keep_only(self, replica_ids: Set[str]) -> None:
        """Drop the records of every replica not in ``replica_ids``."""
        for rid in [r for r in self._recorded if r not in replica_ids]:
            del self._recorded[rid]

    def _fresh(self, replica_id: str) -> Set[int]:
        rec = self._recorded.get(replica_id)
        if rec is None:
            return frozenset()
        horizon = self._clock() - self.config.optimistic_ttl_s
        while rec.at:
            h, t = next(iter(rec.at.items()))
            if t >= horizon:
                break
            rec.at.popitem(last=False)
        return rec.at.keys()
